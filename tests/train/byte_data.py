"""The trainer tests' datasets: seven sonnets as bytes, in place of ``fp4moe.data.build_token_datasets`` (tests only).

Real text, tokenized as bytes: tests/fixtures/sonnets.txt (seven of Shakespeare's sonnets, public domain), token
id = byte value (vocab 256, below the tiny model's 512), the last sonnet held out for validation. Sample ``i`` is
the ``seq_length + 1`` tokens starting at ``i * seq_length``, exactly the interface the trainer codes against.
:func:`install` is the ONE place the swap happens (the fixture in conftest.py and the CLI runner call it). Why
not the real pipeline: it trains a BPE tokenizer and writes an indexed dataset per build folder, seconds the
trainer tests need not pay each; the pipeline has its own tests (tests/data), and the CLI tests of data errors run
the trainer on it (tests/train/test_cli.py).
"""
from __future__ import annotations

from pathlib import Path

import torch

TEXT = Path(__file__).resolve().parents[1] / "fixtures" / "sonnets.txt"
VALID_FROM = "CXXX\n"  # the held-out sonnet


class ByteDataset:
    """Map-style: ``ds[i]`` -> LongTensor [seq_length + 1], deterministic."""

    def __init__(self, tokens: torch.Tensor, seq_length: int) -> None:
        self.tokens, self.seq = tokens, seq_length

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.tokens[i * self.seq:(i + 1) * self.seq + 1].clone()


def build_token_datasets(settings):
    """The trainer's call, with the run's fp4moe.settings.Settings."""
    raw = TEXT.read_bytes()
    cut = raw.index(VALID_FROM.encode())
    seq = settings.parallel.seq_length
    as_tokens = lambda b: torch.tensor(list(b), dtype=torch.long)  # noqa: E731
    train, valid = as_tokens(raw[:cut]), as_tokens(raw[cut:])
    info = {"vocab_size": 256, "eod_id": 0, "train_tokens": len(train), "valid_tokens": len(valid),
            "tokenizer_path": "bytes", "dataset_prefix": str(TEXT)}
    return ByteDataset(train, seq), ByteDataset(valid, seq), info


def install(monkeypatch=None) -> None:
    """Make fp4moe.train use this builder (pytest's monkeypatch when given, else a plain assignment)."""
    import fp4moe.train.batches as batches

    if monkeypatch is not None:
        monkeypatch.setattr(batches, "build_token_datasets", build_token_datasets)
    else:
        batches.build_token_datasets = build_token_datasets
