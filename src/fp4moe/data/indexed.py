"""megatron-core 0.16.1 indexed datasets (``<prefix>.bin`` + ``<prefix>.idx``), written and read with its own
``megatron.core.datasets.indexed_dataset`` (imported lazily: ``import megatron.core`` takes seconds).

Layout written here: one megatron "document" per corpus document, holding one sequence = the document's
token ids followed by EOD. So the ``.bin`` is the flat token stream ``doc0 EOD doc1 EOD ...`` in the index's
dtype (``DType.optimal_dtype(vocab_size)``: uint16 below 65500 ids, else int32), little-endian, no header; the
``.idx`` holds the sequence lengths (tokens), byte offsets and document boundaries.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import numpy as np

from fp4moe import known_warnings
from fp4moe.data.errors import DataError


def _mcore():
    known_warnings.install()  # `import megatron.core` warns that TE/apex are absent (known, harmless)
    try:
        from megatron.core.datasets import indexed_dataset
    except ImportError as e:  # pragma: no cover - megatron-core is a dependency
        raise DataError(f"megatron-core is not importable ({e}): pip install -e . (pins megatron-core==0.16.1)") from e
    return indexed_dataset


def token_dtype(vocab_size: int) -> type:
    """megatron-core's choice of token dtype for ``vocab_size`` ids."""
    return _mcore().DType.optimal_dtype(int(vocab_size))


def write_indexed(prefix: str | os.PathLike, documents: Iterable[np.ndarray], dtype: type) -> tuple[int, int]:
    """Write ``<prefix>.bin/.idx`` from 1-D token arrays (each one document, EOD included) with megatron-core's
    ``IndexedDatasetBuilder``. Returns (documents, tokens)."""
    m = _mcore()
    prefix = str(prefix)
    builder = m.IndexedDatasetBuilder(m.get_bin_path(prefix), dtype=dtype)
    n_docs = n_tokens = 0
    try:
        for ids in documents:
            builder.add_document(np.asarray(ids, dtype=dtype), [int(ids.size)])
            n_docs += 1
            n_tokens += int(ids.size)
    finally:
        builder.finalize(m.get_idx_path(prefix))   # closes the .bin; on an error the caller discards both files
    return n_docs, n_tokens


def open_indexed(prefix: str | os.PathLike):
    """megatron-core's ``IndexedDataset`` (mmap) for ``prefix``; DataError when either file is missing."""
    m = _mcore()
    prefix = str(prefix)
    missing = [p for p in (m.get_bin_path(prefix), m.get_idx_path(prefix)) if not Path(p).is_file()]
    if missing:
        raise DataError(f"megatron indexed dataset {prefix!r} lacks {missing}: give the prefix of an existing .bin/.idx "
                        "pair (without the suffix), or rebuild with `python -m fp4moe.data prepare`")
    try:
        return m.IndexedDataset(prefix, mmap=True)
    except Exception as e:
        raise DataError(f"megatron-core cannot read {prefix}.idx ({type(e).__name__}: {e}): not an indexed dataset "
                        "written by megatron-core's IndexedDatasetBuilder") from e


def read_documents(prefix: str | os.PathLike) -> list[np.ndarray]:
    """Every sequence of ``prefix`` as read by megatron-core's reader (tests, checks), copied: the reader's
    arrays are views of its mmap, which it closes when garbage-collected (a view outliving it segfaults)."""
    ds = open_indexed(prefix)
    return [np.array(ds[i]) for i in range(len(ds))]


def first_document(prefix: str | os.PathLike) -> np.ndarray:
    """Sequence 0 of ``prefix`` (copied, see ``read_documents``)."""
    ds = open_indexed(prefix)
    return np.array(ds[0])


def layout(prefix: str | os.PathLike) -> dict:
    """dtype name, sequence count, token count and the token offset where each megatron document starts
    (``doc_token_starts``, length documents + 1), read from the ``.idx`` by megatron-core's reader."""
    ds = open_indexed(prefix)
    lengths = np.array(ds.sequence_lengths, dtype=np.int64)          # copies: ds's mmap dies with ds
    seq_starts = np.concatenate([[0], np.cumsum(lengths)])
    pointers = np.array(ds.index.sequence_pointers, dtype=np.int64)
    if not np.array_equal(pointers, seq_starts[:-1] * np.dtype(ds.index.dtype).itemsize):
        raise DataError(f"{prefix}.bin is not one contiguous token stream (its sequence pointers leave gaps): "
                        "rewrite it with megatron-core's IndexedDatasetBuilder")
    doc_idx = np.array(ds.document_indices, dtype=np.int64)       # sequence index where each document starts
    return {"dtype": np.dtype(ds.index.dtype).name, "sequences": int(lengths.size), "tokens": int(seq_starts[-1]),
            "doc_token_starts": seq_starts[doc_idx]}


__all__ = ["first_document", "layout", "open_indexed", "read_documents", "token_dtype", "write_indexed"]
