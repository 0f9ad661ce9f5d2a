#!/usr/bin/env bash
# The GPU lane on a machine with a GPU and no network (an H100 or H200 here), from a checkout
# that travels there with one bundle piece per call (pieces of <= 60 MiB: `bash dev/gpu-bundle.sh`
# builds them here into .gpu/pieces). Every call is short; the lane runs in its own process
# session between calls. Usage, one verb per call (dev/gpu_lane.md):
#   bash dev/gpu_lane.sh recv            keep the carried piece(s) of .gpu/pieces in /tmp/gpu,
#                                            say which are still missing
#   bash dev/gpu_lane.sh facts           the machine: cores, NUMA nodes, the GPU's own
#                                            cores, clocks (what a speed figure depends on)
#   bash dev/gpu_lane.sh setup           join and check the pieces, install the wheels
#   bash dev/gpu_lane.sh start [TESTS]   the GPU lane (pytest -m gpu) in its own session, in
#                                            three phases (below), or only TESTS, in one process;
#                                            GPU_LANE_PARTS="a1 a2 b" runs only those parts of
#                                            the phases (a machine lost midway: the rest);
#                                            GPU_LANE_B_CPUS="0-7 8-15" pins B's client and its
#                                            vLLM servers to those cores (taskset)
#   bash dev/gpu_lane.sh bench CMD...    a benchmark (e.g. python -m benchmarks.vllm_extract_bench)
#   bash dev/gpu_lane.sh wait SECONDS    until it ends or SECONDS pass; its latest lines
#   bash dev/gpu_lane.sh fetch           its logs and figures to $OUT
#   bash dev/gpu_lane.sh ship ROOT STAGE  a stage's artifact (transfer export) to $OUT in pieces
#   bash dev/gpu_lane.sh land DIR ROOT   such pieces, carried in DIR, into ROOT (transfer import)
#   bash dev/gpu_lane.sh stop            end the lane and every process it started
# The phases, to fit 30 minutes of one GPU: (A) the parts that measure no speed, side by side,
# each vLLM server with 15% of the GPU's memory (EAGLE3_GPU_LANE_OVERRIDES), extraction's
# parity among them (its two rates then share the GPU: the alone figures are in
# docs/benchmarks.md); (B) alone, the speed figures: the pipeline's evaluation (its stages come
# from A) with its speed check, the GPU's clocks and the cores' load sampled every second
# beside it (b_gpu.csv, b_cpu.log); (C) the published card's command. Part r, not in the default
# parts, is the GPU recipe on the target's own answers (all of ShareGPT regenerated through
# vLLM, 4 epochs): up to training in A, its evaluation after C (D).
set -uo pipefail
cd "$(dirname "$0")/.."
G=/tmp/gpu; mkdir -p $G/pieces
# The environment every process of the lane gets: vLLM's CUDA build from the bundle, no
# network, NVLink multicast off (the machines' rule), flashinfer not carried.
export PYTHONPATH=$PWD:$G/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_USE_FLASHINFER_SAMPLER=0 NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TORCHINDUCTOR_CACHE_DIR=$G/inductor \
  TRITON_CACHE_DIR=$G/triton MLFLOW_TRACKING_URI= EAGLE3_GPU_LANE_ROOT=$G/root
PY=${PY:-python3}
# A detached job runs from its own copy of the tree ($G/src): the next call carries a fresh
# working tree over this one, and a job whose folder is replaced dies with "getcwd() failed".
snapshot() {
  rm -rf $G/src.new && mkdir -p $G/src.new
  tar -cf - --exclude=./.gpu --exclude=./.venv --exclude=./.git . | tar -xf - -C $G/src.new
  rm -rf $G/src && mv $G/src.new $G/src
  export PYTHONPATH=$G/src:$G/site
}
case "${1:-}" in
recv)  # carry SHA256SUMS with every piece: a machine lost between calls comes back bare, and
  # this says at once what it lacks
  for f in .gpu/pieces/*; do [ -f "$f" ] && [ ! -e $G/pieces/$(basename "$f") ] && cp "$f" $G/pieces/; done
  $PY scripts/wheelhouse.py missing $G/pieces ;;
facts)
  nproc; lscpu | grep -i "model name\|^cpu(s)\|thread\|core(s)\|socket\|numa\|mhz"
  nvidia-smi --query-gpu=name,pci.bus_id,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,pstate --format=csv
  bus=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader | head -1 | tr 'A-F' 'a-f' | sed 's/^0000//; s/^/0000/')
  echo "the GPU's NUMA node $(cat /sys/bus/pci/devices/${bus:4}/numa_node 2>/dev/null || cat /sys/bus/pci/devices/$bus/numa_node 2>/dev/null), its cores $(cat /sys/bus/pci/devices/${bus:4}/local_cpulist 2>/dev/null || cat /sys/bus/pci/devices/$bus/local_cpulist 2>/dev/null)"
  for c in /sys/devices/system/cpu/cpu[0-9]*; do printf "%s:%s " "${c##*cpu}" "$(cat $c/topology/thread_siblings_list 2>/dev/null)"; done; echo
  command -v taskset numactl ;;
setup)
  s=$(date +%s)
  $PY scripts/wheelhouse.py unbundle $G/pieces $G/wheels || exit 1
  $PY scripts/wheelhouse.py install $G/wheels --target $G/site > $G/install.log 2>&1 || { tail -20 $G/install.log; exit 1; }
  echo "installed in $(( $(date +%s) - s )) s: $(ls $G/wheels/*.whl | wc -l) wheels, $(du -sm $G/site | cut -f1) MiB"
  $PY -c "import vllm, torch, transformers, speculators; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | tail -2 ;;
start)
  shift
  rm -f $G/*.rc $G/a?.log $G/b.log $G/c.log $G/lane.log $G/phases.txt
  date > $G/started
  snapshot
  if [ $# -gt 0 ]; then
    (cd $G/src && setsid nohup bash -c "$PY -m pytest -m gpu -v -s -p no:cacheprovider $* > $G/lane.log 2>&1; echo \$? > $G/lane.rc" > /dev/null 2>&1 < /dev/null &)
  else
    (cd $G/src && setsid nohup bash dev/gpu_lane.sh phases > /dev/null 2>&1 < /dev/null &)
  fi
  sleep 2; echo "started: ${*:-all three phases}" ;;
bench)  # a benchmark in the lane's environment, in its own session: bench python -m benchmarks.X ...
  # (several commands joined by ';' all log to bench.log: the whole line runs in one subshell)
  shift
  rm -f $G/*.rc $G/bench.log
  date > $G/started
  snapshot
  (cd $G/src && setsid nohup bash -c "( $* ) > $G/bench.log 2>&1; echo \$? > $G/lane.rc" > /dev/null 2>&1 < /dev/null &)
  sleep 2; echo "started: $*" ;;
phases)  # what `start` runs in the background: A side by side, then B, then C
  L=tests/test_gpu_lane.py
  lane() {  # NAME ROOT TESTS...: one pytest process, its log $G/NAME.log, its exit in NAME.rc
    local name=$1 root=$2; shift 2
    case " ${GPU_LANE_PARTS:-a1 a2 a3 a4 a5 a6 b b2 c} " in *" $name "*) ;; *) return 0 ;; esac
    EAGLE3_GPU_LANE_ROOT=$root $PY -m pytest -m gpu -v -s -p no:cacheprovider "$@" > $G/$name.log 2>&1
    echo $? > $G/$name.rc
  }
  recipe() {  # NAME STAGES: the GPU recipe on the target's own answers (issue 29), its log
    # $G/NAME.log (appended: A runs it up to training, D its evaluation)
    local name=$1
    case " ${GPU_LANE_PARTS:-a1 a2 a3 a4 a5 a6 b b2 c} " in *" $name "*) ;; *) return 0 ;; esac
    $PY -m runner hardware=gpu1 regenerate=vllm regenerate.concurrency=512 data.num_samples=17528 \
      train.epochs=4 eval.num_prompts=80 eval.compare_target=false hardware.vllm_memory_utilization=0.3 \
      run.output_root=$G/root_r run.name=gpu-recipe-target-answers ${2:+"$2"} >> $G/$name.log 2>&1
    echo $? > $G/$name.rc
  }
  s=$(date +%s)
  export EAGLE3_GPU_LANE_OVERRIDES="hardware.vllm_memory_utilization=0.15 hardware.vllm_kv_cache_gib=6"
  # a1 trains (B serves its draft), then a6 serves each epoch's draft (the learning curve)
  { lane a1 $G/root $L::test_the_gpu_recipe_trains_and_keeps_every_epochs_draft
    lane a6 $G/root $L::test_the_learning_curve_each_epochs_draft_served; } &
  lane a2 $G/root_kimi tests/test_kimi_miniature.py &
  lane a3 $G/root_a3 $L::test_online_training_shares_the_one_gpu_with_its_server &
  lane a5 $G/root_a5 $L::test_regeneration_through_vllm_on_the_gpu \
    $L::test_vllm_extraction_matches_the_in_process_backend_on_the_gpu &
  lane a4 $G/root_a4 $L::test_a_stopped_gpu_training_resumes_and_redoes_no_step \
    tests/test_train_resume.py &
  recipe r "run.stages=[regenerate,prepare,extract,vocab,train]" &
  wait; echo "phase A: $(( $(date +%s) - s )) s" > $G/phases.txt
  unset EAGLE3_GPU_LANE_OVERRIDES
  pin=()
  if [ -n "${GPU_LANE_B_CPUS:-}" ]; then  # "CLIENT SERVERS": the client's cores, the servers'
    set -- $GPU_LANE_B_CPUS; pin=(taskset -c "$1")
    export EAGLE3_GPU_LANE_OVERRIDES="hardware.vllm.command=[taskset,-c,'$2',$PY,-m,vllm.entrypoints.openai.api_server]"
  fi
  case " ${GPU_LANE_PARTS:-a1 a2 a3 a4 a5 a6 b b2 c} " in *" b "*)
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu,temperature.gpu,pstate \
      --format=csv -lms 1000 > $G/b_gpu.csv 2>&1 &
    gpu_sampler=$!
    while :; do echo "$(date +%s.%N | cut -c1-14) $(head -1 /proc/stat) $(grep MHz /proc/cpuinfo | awk '{printf "%d ", $4}')"; sleep 1; done > $G/b_cpu.log &
    cpu_sampler=$! ;;
  esac
  PY="${pin[*]} $PY" lane b $G/root $L::test_the_pipeline_serves_its_draft_warm_and_explains_every_divergence \
    $L::test_the_speed_ratio_agrees_with_an_independent_client_on_the_same_servers
  kill ${gpu_sampler:-} ${cpu_sampler:-} 2>/dev/null
  unset EAGLE3_GPU_LANE_OVERRIDES
  # b2, alone too: the gain at 1 to 64 streams and the draft against its first epoch's
  lane b2 $G/root $L::test_the_gain_by_concurrency_and_against_a_baseline_draft
  echo "phase B: $(( $(date +%s) - s )) s" >> $G/phases.txt
  lane c $G/root $L::test_the_published_cards_command_serves_the_draft
  echo "phase C: $(( $(date +%s) - s )) s" >> $G/phases.txt
  recipe r ""  # its evaluation, the stages before it from A
  echo "phase D: $(( $(date +%s) - s )) s" >> $G/phases.txt
  cat $G/*.rc 2>/dev/null | sort -u | tail -1 > $G/lane.rc ;;
wait)
  # A machine that went back between calls comes back bare: say so at once rather than wait
  # SECONDS for a lane that is not there.
  if [ ! -f $G/started ]; then
    echo "no lane was started on this machine: it is a fresh one (the one that ran start went back); carry the pieces again (recv, setup, start)"
    exit 3
  fi
  for _ in $(seq "${2:-1}"); do [ -f $G/lane.rc ] && break; sleep 1; done
  cat $G/phases.txt 2>/dev/null
  for f in $G/*.log; do
    [ "$f" = $G/install.log ] && continue
    echo "--- $(basename $f) $([ -f ${f%.log}.rc ] && echo "exit $(cat ${f%.log}.rc)" || echo running)"
    grep -a "PASSED\|FAILED\|ERROR\|passed\|failed" $f | cut -c1-300 | tail -4
    # A failure's own lines at once: a machine that goes back takes the log with it.
    grep -a "^E " $f | head -12 | cut -c1-300
    tr '\r' '\n' < $f | grep -v '^\s*$' | tail -2 | cut -c1-250
  done
  [ -f $G/lane.rc ] && echo "finished: exit $(cat $G/lane.rc)" || echo running ;;
fetch)
  grep -a "^BENCH" $G/bench.log > $OUT/bench.txt 2>/dev/null
  for f in $G/*.log $G/phases.txt; do [ -f "$f" ] && [ "$f" != $G/install.log ] && cp "$f" $OUT/; done
  cat $G/*.log | grep -a "GPU-FIGURES" > $OUT/figures.txt 2>/dev/null
  cp $G/speed_*.json $G/b_gpu.csv $G/b_cpu.log $OUT/ 2>/dev/null
  # The patterns are expanded inside $G (expanded here they matched nothing, and tar wrote an
  # empty archive); each stage's manifest holds its counts (regenerate's: rows, tokens, failures).
  (cd $G && tar -czf $OUT/logs.tar.gz --exclude='*.safetensors' --exclude='*.pt' --exclude='*.npy' \
    --exclude='*.arrow' $(ls -d root/store/evaluate root/store/extract root_r/store/evaluate \
    root_r/store/regenerate/*/manifest.json root_r/store/prepare/*/manifest.json \
    root_r/store/train/*/metrics.jsonl root_r/store/train/*/manifest.json 2>/dev/null))
  tar -tzf $OUT/logs.tar.gz | wc -l | sed 's/$/ files in logs.tar.gz/' 
  ls -l $OUT ;;
ship)  # ship ROOT STAGE: a stage's newest artifact of ROOT (transfer export, checked by its
  # manifest) to $OUT as gzip pieces of <= 15 MiB (at most 8 files of 16 MiB come back a call)
  rm -rf $G/ship && (cd $G/src 2>/dev/null || cd .; $PY -m runner transfer export "$3" $G/ship --output-root "$2") || exit 1
  (cd $G && tar -cf - ship | gzip -6 | split -b 15M -d - $OUT/ship.tar.gz.)
  (cd $OUT && sha256sum ship.tar.gz.* > ship.sha256); ls -l $OUT ;;
land)  # land DIR ROOT: pieces of `ship` carried in DIR (ignored, named in carry) into ROOT's store
  (cd "$2" && sha256sum -c ship.sha256) || exit 1
  rm -rf $G/ship && cat "$2"/ship.tar.gz.* | gzip -dc | tar -xf - -C $G && $PY -m runner transfer import $G/ship "$3" ;;
stop)  # (bracketed patterns: a pattern must not match the command line of the call that runs it)
  pkill -f "gpu_lane.sh [p]hases"; pkill -f "pytest -m [g]pu"; pkill -f "[b]enchmarks\."
  pkill -f "[v]llm.entrypoints"; sleep 3; pkill -9 -f "[v]llm.entrypoints"; echo stopped ;;
*) sed -n 2,31p "$0"; exit 2 ;;
esac
