#!/usr/bin/env bash
# The evaluate stage's speed ratio and its same-server check (eval.speed_check) on one H200, for
# a draft trained elsewhere (eval.draft), twice in one session: first on a fresh machine, where
# both servers compile their graphs cold (MT-bench and HumanEval), then again with vLLM's compile
# cache warm (MT-bench only: the speed is measured on the first set), so that a cold start's
# effect on the ratio shows in one session.
# In the GPU lane's environment (dev/gpu_lane.md), after `bash dev/gpu_lane.sh setup`:
#   bash dev/gpu_lane.sh bench bash dev/h200_speed_check.sh DRAFT [ROOT]
# Prints one `SPEED <pass> {...}` line per pass (the stage's speed metrics) and keeps each pass's
# speed.json (every repeat of both measurements) as /tmp/gpu/speed_<pass>.json.
set -uo pipefail
cd "$(dirname "$0")/.."
draft=$1
root=${2:-/tmp/gpu/root_speed}
run=(python3 -m runner hardware=gpu1 "eval.draft=$draft" "run.stages=[evaluate]"
     eval.speed_check=true "run.output_root=$root")
for pass in cold warm; do
  echo "=== $pass"
  extra=("eval.prompts=[mtbench,humaneval]")
  [ "$pass" = warm ] && extra=("eval.prompts=[mtbench]")
  "${run[@]}" "${extra[@]}" "run.name=speed-$pass" || exit $?
  d=$(ls -td "$root"/store/evaluate/*/ | head -1)
  python3 - "$d" "$pass" <<'EOF'
import json, sys
m = json.load(open(f"{sys.argv[1]}/manifest.json"))["metrics"]
keep = {k: v for k, v in m.items() if "speed" in k or "compile" in k or "tok_s" in k or k == "server_start_s"}
print("SPEED", sys.argv[2], json.dumps(keep), flush=True)
EOF
  cp "$d/speed.json" "/tmp/gpu/speed_$pass.json"
done
