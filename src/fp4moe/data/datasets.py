"""The trainer's entry point: ``train_ds, valid_ds, info = build_token_datasets(settings)``."""
from __future__ import annotations

from pathlib import Path

from fp4moe.data.build import prepare
from fp4moe.data.samples import TokenWindows
from fp4moe.settings import Settings


def build_token_datasets(s: Settings, log=print) -> tuple[TokenWindows, TokenWindows, dict]:
    """Build (or reuse) the corpus, tokenizer and indexed files of ``s`` (the run's fp4moe.settings.Settings, built
    once from the composed conf/train.yaml: uses ``s.data``, ``s.model.vocab_size``, the sequence length
    ``s.parallel.seq_length`` and the sample-order seed ``s.data.seed``), and return the training and validation
    datasets and an info dict.

    Each dataset is map-style: ``len(ds)`` samples, ``ds[i]`` a torch.int64 tensor [seq_length + 1] (inputs
    ``[:-1]``, labels ``[1:]``), consecutive windows of the split's documents as stored, EOD after each document
    (fp4moe.data.samples). Training windows are shuffled by the seed (sample i is the same window on every
    machine); validation windows are in stream order. For more passes than one, ``train_ds.with_epoch(e)`` gives
    the same windows reshuffled for pass ``e`` (fp4moe.data.samples.epoch_seed).

    ``info``: tokenizer_path, vocab_size (tokenizer ids), model_vocab_size, eod_id, eod_token, train_tokens,
    valid_tokens, train_samples, valid_samples, seq_length, seed, dataset_prefix (the training split's
    megatron prefix), valid_prefix, dataset_dir (build directory), manifest_path, key, reused.
    """
    m = prepare(s, log=log)
    seq, seed = s.parallel.seq_length, s.data.seed
    build = Path(m["dir"])

    def prefix(split: str) -> str:
        p = Path(m["splits"][split]["prefix"])
        return str(p if p.is_absolute() else build / p)

    def windows(split: str, shuffle_seed: int | None) -> TokenWindows:
        s = m["splits"][split]
        return TokenWindows(prefix(split) + ".bin", m["dtype"], s["begin"], s["end"], seq, seed=shuffle_seed,
                            name=split)

    train, valid = windows("train", seed), windows("valid", None)
    info = {
        "tokenizer_path": str(build / m["tokenizer"]["file"]),
        "vocab_size": m["tokenizer"]["vocab_size"],
        "model_vocab_size": m["model_vocab_size"],
        "eod_id": m["tokenizer"]["eod_id"],
        "eod_token": m["tokenizer"]["eod_token"],
        "train_tokens": m["splits"]["train"]["tokens"],
        "valid_tokens": m["splits"]["valid"]["tokens"],
        "train_samples": len(train),
        "valid_samples": len(valid),
        "seq_length": seq,
        "seed": seed,
        "dataset_prefix": prefix("train"),
        "valid_prefix": prefix("valid"),
        "dataset_dir": str(build),
        "manifest_path": str(build / "manifest.json"),
        "key": m["key"],
        "reused": m["reused"],
    }
    return train, valid, info


__all__ = ["build_token_datasets"]
