#!/usr/bin/env bash
# Build .whl/py312: the Python 3.12 wheels that the GPU image lacks (megatron-core, hydra, MLflow's sqlite store,
# submitit), at the pins of pyproject.toml, for `tools/device/h200_p3.sh setup` (pip install --no-deps into
# /tmp/site). Run on a CPU machine with PyPI access:   bash tools/device/wheels_py312.sh
#
# Left out on purpose, to keep the carried tree under the device tool's 64 MiB:
# - what the image already has (the device image's package list): torch, triton, numpy, pyyaml,
#   requests and its closure, click, cloudpickle, protobuf, packaging, typing-extensions, markupsafe, h11, anyio, ...;
#   a wheel of ours on /tmp/site would shadow the image's copy;
# - greenlet (SQLAlchemy's asyncio only) and gitpython / gitdb / smmap (MLflow's optional git tags; the device gets
#   no .git anyway): a tiny training run with these four hidden logged to MLflow as before (2026-12-01).
# MLflow's sqlite store does import cryptography (mlflow.store.db.base_sql_model) and databricks-sdk: they stay.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.whl/py312
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
plat=(--only-binary :all: --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform any)
pin() { sed -n "s/^ *\"\\($1==[^\"]*\\)\".*/\\1/p" pyproject.toml; }
python3 -m pip download -q "${plat[@]}" -d "$tmp" "$(pin mlflow-skinny)" "$(pin sqlalchemy)" "$(pin alembic)" \
  "$(pin submitit)"
python3 -m pip download -q --no-deps "${plat[@]}" -d "$tmp" "$(pin megatron-core)" "$(pin hydra-core)" \
  "$(pin omegaconf)" "$(pin hydra-submitit-launcher)"
# hydra-core's antlr4 runtime is an sdist only: build its (pure Python) wheel here
python3 -m pip download -q --no-deps --no-binary :all: -d "$tmp/sdist" antlr4-python3-runtime==4.9.3
python3 -m pip wheel -q --no-deps -w "$tmp" "$tmp"/sdist/antlr4-python3-runtime-4.9.3.tar.gz
on_image="annotated_doc anyio certifi charset_normalizer click cloudpickle h11 idna markupsafe packaging protobuf pyyaml
requests typing_extensions urllib3 zipp greenlet gitpython gitdb smmap"
for name in $on_image; do rm -f "$tmp/$name"-*.whl; done
mkdir -p "$out"
rm -f "$out"/*.whl
cp "$tmp"/*.whl "$out"/
echo "$(ls "$out" | wc -l) wheels, $(du -sh "$out" | cut -f1) in $out"
