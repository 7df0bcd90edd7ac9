#!/usr/bin/env bash
# The rollout throughput benchmark on the device, in the background, so that it outlives one device call.
#   (device, after the vllm-bundle install; from the repository root)
#   bash benchmarks/gpu/run_throughput.sh start "RUN_OPTIONS" ["RUN_OPTIONS" ...]
#        versions, then one rollout_throughput.py run per argument, one after another (setsid)
#   bash benchmarks/gpu/run_throughput.sh collect [WAIT_S]
#        waits up to WAIT_S seconds, prints the tables so far, copies logs and JSON into $OUT
set -uo pipefail
# Works in $TIC_GPU_WORK/throughput (run logs and JSON).
source "$(dirname "$0")/device_env.sh"
W=$WORK/throughput; mkdir -p "$W"
cmd=${1:-}; shift || true
case "$cmd" in
start)
  versions "$W/versions.txt"
  script=$W/all.sh; : > "$script"; i=0
  prev=""  # with .carry/prev/ (device_env.sh's previous_tree) a `previous` side can run
  [ -d "$REPO/.carry/prev" ] && prev="--previous-pythonpath $(previous_tree)"
  for opts in "$@"; do
    i=$((i + 1))
    echo "python3 $REPO/benchmarks/gpu/rollout_throughput.py $opts $prev --out $W/run$i.json > $W/run$i.log 2>&1" >> "$script"
  done
  cd "$REPO" && setsid nohup bash "$script" > "$W/all.log" 2>&1 < /dev/null &
  sleep 2; cat "$script"
  ;;
collect)
  end=$(( $(date +%s) + ${1:-0} ))
  while pgrep -f rollout_throughput.py > /dev/null && [ "$(date +%s)" -lt "$end" ]; do sleep 10; done
  pgrep -f rollout_throughput.py > /dev/null && echo "benchmark still running" || echo "benchmark finished"
  for f in "$W"/run*.log; do echo "== $f"; grep -v '^{' "$f" | grep -iv "warn\|info" | tail -n 12; grep -c '^{"shape"' "$f"; done
  tar czf "$OUT/throughput.tgz" -C "$W" --exclude=all.sh . 2>/dev/null  # one file: a call returns few
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv
  ;;
*) sed -n '2,7p' "$0"; exit 2 ;;
esac
