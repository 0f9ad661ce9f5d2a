#!/usr/bin/env bash
# The GPU measurements of docs/benchmarks.md ("Multi-GPU training"), on a machine with 2 GPUs
# and no network, from this checkout plus a wheelhouse (scripts/wheelhouse.py build .whl
# --have dev/targets/h200.txt). Results go to $OUT (default ./gpu_results) as JSON lines.
#   bash dev/h200_train.sh part1   # install, synthetic Kimi store, 1 GPU, direct
#   bash dev/h200_train.sh part2   # 2 GPUs DDP, kill -9 of one rank and resume
#   bash dev/h200_train.sh part3   # fp8 hidden-state storage against bf16, 1 GPU
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_results}; mkdir -p "$OUT"
ROOT=/tmp/bench; STEPS=${STEPS:-30}
export PYTHONPATH=$PWD:/tmp/site NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor TRITON_CACHE_DIR=/tmp/triton
MEM=(hardware.gpu_memory_gib=96)   # compare against an RTX PRO 6000
if [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    $(ls .whl/*.whl | grep -v eagle3_runner) || exit 1
fi
bench() { python3 -m benchmarks.train_scaling "$@" --root $ROOT --shape kimi; }
case "$1" in
part1)
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.txt"
  [ -d $ROOT/out/store ] || bench setup --rows 512 --files 16 2>&1 | tail -2
  bench train --gpus 1 --steps "$STEPS" "${MEM[@]}" > "$OUT/train1.log" 2>&1
  tail -1 "$OUT/train1.log" | tee -a "$OUT/results.jsonl"
  bench direct --steps "$STEPS" > "$OUT/direct1.log" 2>&1
  tail -1 "$OUT/direct1.log" | tee -a "$OUT/results.jsonl"
  ;;
part2)
  [ -d $ROOT/out/store ] || bench setup --rows 512 --files 16 2>&1 | tail -2
  bench train --gpus 2 --steps "$STEPS" "${MEM[@]}" > "$OUT/train2.log" 2>&1
  tail -1 "$OUT/train2.log" | tee -a "$OUT/results.jsonl"
  # kill -9 of one rank mid-epoch, then the same command resumes.
  ARGS=(--gpus 2 --steps 40 "${MEM[@]}" train.checkpoint_every=0.25 train.echo_steps=true)
  bench train "${ARGS[@]}" > "$OUT/killed.log" 2>&1 &
  until grep -q "global_step': 2[2-9]" /tmp/bench/out/scratch/train-*/logs/train.log 2>/dev/null; do
    sleep 2; done
  pkill -9 -n -f runner.integrations.speculators_worker; wait
  echo "killed run exit: $(grep -c 'torchrun exit' "$OUT/killed.log") torchrun-exit line(s)"
  pgrep -f speculators_worker && echo "RANKS LEFT" || echo "no rank left"
  bench train "${ARGS[@]}" > "$OUT/resumed.log" 2>&1
  tail -1 "$OUT/resumed.log" | tee -a "$OUT/results.jsonl"
  grep -h '"resumes"\|steps_redone' /tmp/bench/out/store/train/*/manifest.json | head -4
  ;;
part3)  # fp8 hidden-state storage against bf16, Kimi shape, 1 GPU, one after the other
  for st in ${STORAGES:-bf16 fp8}; do
    bench setup --rows 512 --files 16 extract.storage=$st 2>&1 | tail -1
  done
  for d in $ROOT/out/store/extract/*/; do
    echo "$(du -sh "$d/hidden_states" | cut -f1) $(grep -o '"storage": "[a-z0-9]*"' "$d/manifest.json")"
  done | tee "$OUT/storage_sizes.txt"
  for st in ${STORAGES:-bf16 fp8}; do
    bench train --gpus 1 --steps "$STEPS" "${MEM[@]}" extract.storage=$st > "$OUT/train_$st.log" 2>&1
    echo "{\"storage\": \"$st\", \"result\": $(tail -1 "$OUT/train_$st.log")}" | tee -a "$OUT/results.jsonl"
  done
  ;;
esac
