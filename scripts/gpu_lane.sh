#!/usr/bin/env bash
# The GPU lane on a machine with a GPU and no network (this workplace's H200s), from a checkout
# that travels there with one bundle piece per call (pieces of <= 60 MiB: `make gpu-bundle`
# builds them here into .gpu/pieces). Every call is short; the lane runs in its own process
# session between calls. Usage, one verb per call (docs/gpu.md):
#   bash scripts/gpu_lane.sh recv            keep the carried piece(s) of .gpu/pieces in /tmp/gpu
#   bash scripts/gpu_lane.sh setup           join and check the pieces, install the wheels
#   bash scripts/gpu_lane.sh start [TESTS]   the GPU lane (pytest -m gpu) in its own session
#   bash scripts/gpu_lane.sh wait SECONDS    until it ends or SECONDS pass; its latest lines
#   bash scripts/gpu_lane.sh fetch           its log and figures to $OUT
#   bash scripts/gpu_lane.sh stop            end the lane and every process it started
set -uo pipefail
cd "$(dirname "$0")/.."
G=/tmp/gpu; mkdir -p $G/pieces
# The environment every process of the lane gets: vLLM's CUDA build from the bundle, no
# network, NVLink multicast off (the workplace's rule), flashinfer not carried.
export PYTHONPATH=$PWD:$G/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_USE_FLASHINFER_SAMPLER=0 NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TORCHINDUCTOR_CACHE_DIR=$G/inductor \
  TRITON_CACHE_DIR=$G/triton MLFLOW_TRACKING_URI= EAGLE3_GPU_LANE_ROOT=$G/root
PY=${PY:-python3}
case "${1:-}" in
recv)
  for f in .gpu/pieces/*; do [ -f "$f" ] && cp -n "$f" $G/pieces/; done
  ls -l $G/pieces | tail -n +2 ;;
setup)
  s=$(date +%s)
  $PY scripts/wheelhouse.py unbundle $G/pieces $G/wheels || exit 1
  $PY scripts/wheelhouse.py install $G/wheels --target $G/site > $G/install.log 2>&1 || { tail -20 $G/install.log; exit 1; }
  echo "installed in $(( $(date +%s) - s )) s: $(ls $G/wheels/*.whl | wc -l) wheels, $(du -sm $G/site | cut -f1) MiB"
  $PY -c "import vllm, torch, transformers, speculators; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | tail -2 ;;
start)
  shift
  tests=${*:-tests/test_train_resume.py tests/test_gpu_lane.py tests/test_kimi_miniature.py}
  rm -f $G/lane.rc
  setsid nohup bash -c "$PY -m pytest -m gpu -v -s -p no:cacheprovider $tests > $G/lane.log 2>&1; echo \$? > $G/lane.rc" > /dev/null 2>&1 < /dev/null &
  sleep 2; echo "started: $tests" ;;
wait)
  for _ in $(seq "${2:-1}"); do [ -f $G/lane.rc ] && break; sleep 1; done
  grep -a "PASSED\|FAILED\|ERROR\|SKIPPED\|GPU-FIGURES\|passed\|failed" $G/lane.log | cut -c1-600 | tail -12
  echo "--- tail"; tr '\r' '\n' < $G/lane.log | grep -v '^\s*$' | tail -4 | cut -c1-300
  [ -f $G/lane.rc ] && echo "finished: exit $(cat $G/lane.rc)" || echo running ;;
fetch)
  cp $G/lane.log $OUT/ 2>/dev/null
  grep -a "GPU-FIGURES" $G/lane.log > $OUT/figures.txt 2>/dev/null
  tar -czf $OUT/logs.tar.gz -C $G --exclude='*.safetensors' --exclude='*.pt' --exclude='*.npy' --exclude='*.arrow' \
    root/store/evaluate root/store/extract 2>/dev/null
  ls -l $OUT ;;
stop)
  pkill -f "pytest -m gpu" ; pkill -f "vllm.entrypoints" ; sleep 3; pkill -9 -f "vllm.entrypoints"; echo stopped ;;
*) sed -n 2,13p "$0"; exit 2 ;;
esac
