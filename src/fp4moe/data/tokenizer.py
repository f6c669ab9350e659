"""Tokenizers: a byte-level BPE trained on the training split, or a user's HuggingFace tokenizer.json.

Both are HuggingFace ``tokenizers`` objects (pinned 0.23.2, the GPU image's version, so a tokenizer.json made
here loads there unchanged). The end-of-document token (EOD) separates documents in the indexed files:

* trained (``kind: bpe_bytelevel``): ``models.BPE`` with a ``ByteLevel`` pre-tokenizer (no prefix space) and
  decoder, the 256-byte initial alphabet, ``min_frequency=2``, and ``<|endoftext|>`` as special token id 0;
  ``vocab_size`` counts every id (bytes + merges + EOD), so it must be >= 257. Training is deterministic: the
  same texts give a byte-identical tokenizer.json (tested).
* ``kind: hf``: ``Tokenizer.from_file(path)``; EOD = ``data.tokenizer.eod`` when set, else the first of
  ``KNOWN_EOD_TOKENS`` the vocabulary has; a tokenizer with none of them gets ``<|endoftext|>`` added as a
  special token (the modified tokenizer.json is what the dataset stores).

Ids are encoded without special tokens (no BOS/EOS from a post-processor); the pipeline appends EOD itself.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from fp4moe.data.errors import DataError

EOD_TOKEN = "<|endoftext|>"
# End-of-text tokens of common tokenizers: GPT-2/tiktoken style, DeepSeek-V2/V3, Llama-2/T5, Llama-3, Gemma.
KNOWN_EOD_TOKENS = (EOD_TOKEN, "<｜end▁of▁sentence｜>", "</s>", "<|end_of_text|>", "<eos>")
MIN_BPE_VOCAB = 257                       # 256 byte tokens + EOD


def train_bpe(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE with ``vocab_size`` ids in all (fewer if the texts run out of pairs to merge), EOD id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if int(vocab_size) < MIN_BPE_VOCAB:
        raise DataError(f"a byte-level BPE needs vocab_size >= {MIN_BPE_VOCAB} (256 bytes + EOD), got {vocab_size}: "
                        "raise model.vocab_size")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=int(vocab_size), min_frequency=2, show_progress=False,
                                  special_tokens=[EOD_TOKEN], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_hf(path: str | Path, eod: str | None = None):
    """(tokenizer, eod_token) from a tokenizer.json; adds ``<|endoftext|>`` when it has no known EOD token."""
    from tokenizers import Tokenizer

    p = Path(path)
    if not p.is_file():
        raise DataError(f"tokenizer file {str(p)!r} does not exist: point data.tokenizer.path (or FP4MOE_TOKENIZER) at a "
                        "HuggingFace tokenizer.json, or set data.tokenizer.kind=bpe_bytelevel to train one")
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises a bare Exception for a bad file
        raise DataError(f"{p} is not a HuggingFace tokenizer.json ({e}): give the tokenizer.json of a tokenizers/"
                        "transformers tokenizer (not a sentencepiece .model or a tiktoken file)") from e
    if eod is not None:
        if tok.token_to_id(eod) is None:
            raise DataError(f"data.tokenizer.eod={eod!r} is not in {p}'s vocabulary: name one of its tokens, or null")
        return tok, eod
    for cand in KNOWN_EOD_TOKENS:
        if tok.token_to_id(cand) is not None:
            return tok, cand
    tok.add_special_tokens([EOD_TOKEN])
    return tok, EOD_TOKEN


def to_json_bytes(tok) -> bytes:
    """The tokenizer.json bytes (what is stored and hashed)."""
    return tok.to_str().encode("utf-8")


def sha256_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def vocab_size(tok) -> int:
    """Number of ids, added tokens included (ids are 0 .. vocab_size - 1)."""
    return int(tok.get_vocab_size(with_added_tokens=True))


def encode_documents(tok, texts: Sequence[str], eod_id: int, dtype) -> list[np.ndarray]:
    """One 1-D array per text: its ids followed by ``eod_id``, in ``dtype``."""
    out = []
    for enc in tok.encode_batch(list(texts), add_special_tokens=False):
        ids = np.empty(len(enc.ids) + 1, dtype=dtype)
        ids[:-1] = enc.ids
        ids[-1] = eod_id
        out.append(ids)
    return out


__all__ = ["EOD_TOKEN", "KNOWN_EOD_TOKENS", "MIN_BPE_VOCAB", "encode_documents", "load_hf", "sha256_bytes",
           "to_json_bytes", "train_bpe", "vocab_size"]
