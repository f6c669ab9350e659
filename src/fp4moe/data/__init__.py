"""Real data for training (P3, issue 4): corpus -> tokenizer -> megatron-core indexed files -> token windows.

    from fp4moe.data import build_token_datasets
    train_ds, valid_ds, info = build_token_datasets(Settings.from_config(cfg))   # cfg: composed conf/train.yaml
    python -m fp4moe.data prepare data=shakespeare model=tiny_cpu   # build once, print the manifest

Modules: ``corpus`` (sources and splits), ``tokenizer`` (BPE training / tokenizer.json, EOD), ``indexed``
(megatron-core .bin/.idx writer and reader), ``build`` (idempotent atomic build + manifest), ``samples``
(``TokenWindows``, the map-style dataset), ``datasets`` (``build_token_datasets``), ``errors`` (``DataError``).
Both take the run's :class:`fp4moe.settings.Settings` (``Settings.from_config(cfg)``, built once by the entry point),
never the raw composed config. Imports are lazy: ``import fp4moe.data`` loads neither torch nor megatron-core.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from fp4moe.data.errors import DataError

if TYPE_CHECKING:
    from fp4moe.settings import Settings


def build_token_datasets(s: "Settings", log=print):
    """See ``fp4moe.data.datasets.build_token_datasets``."""
    from fp4moe.data.datasets import build_token_datasets as _build
    return _build(s, log=log)


def prepare(s: "Settings", log=print) -> dict:
    """See ``fp4moe.data.build.prepare``."""
    from fp4moe.data.build import prepare as _prepare
    return _prepare(s, log=log)


__all__ = ["DataError", "build_token_datasets", "prepare"]
