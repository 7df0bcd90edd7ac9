#!/usr/bin/env bash
# The shape sweep on the device (docs/results/shape-sweep.md), in the background, so that it outlives one device
# call (10 minutes at most).
#   (device, after the vllm-bundle install; from the repository root)
#   bash benchmarks/gpu/run_sweep.sh start [shape_sweep.py run options ...]
#        versions, the norm launch probe stock and patched (each a fresh process), then the sweep (setsid)
#   bash benchmarks/gpu/run_sweep.sh collect [WAIT_S]
#        waits up to WAIT_S seconds for the sweep, prints its progress and table, packs results into $OUT
# With .carry/prev/ present (files of an earlier release at their repository paths, device_env.sh's
# previous_tree), the variant `previous` runs on a copy of this tree holding them: a patch change's with/without.
# Works in $TIC_GPU_WORK/sweep (work/: configs, models, state; out/: records, logs, table).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
S=$WORK/sweep; R=$S/out; mkdir -p "$S" "$R"
cmd=${1:-}; shift || true
case "$cmd" in
start)
  versions "$R/versions.txt"
  prev=""
  [ -d "$REPO/.carry/prev" ] && prev="--previous-pythonpath $(previous_tree)"
  for v in "" --patched; do
    python3 "$GPU/norm_launch_probe.py" $v > "$R/probe${v:-stock}.txt" 2>&1
    echo "exit $?" >> "$R/probe${v:-stock}.txt"
  done
  tail -n 30 "$R"/probe*.txt
  cd "$REPO" && setsid nohup python3 "$GPU/shape_sweep.py" run "$S/work" "$R" $prev "$@" > "$R/sweep.log" 2>&1 < /dev/null &
  sleep 5; tail -n 5 "$R/sweep.log"
  ;;
collect)
  end=$(( $(date +%s) + ${1:-0} ))
  while pgrep -f shape_sweep.py > /dev/null && [ "$(date +%s)" -lt "$end" ]; do sleep 10; done
  pgrep -f shape_sweep.py > /dev/null && echo "sweep still running" || echo "sweep finished"
  tail -n 40 "$R/sweep.log"
  python3 "$GPU/shape_sweep.py" table "$R" > /dev/null 2>&1; cat "$R/table.md" 2>/dev/null
  grep -h "\] C[0-9]" "$R"/*.log | tail -n 60
  cp "$R/table.md" "$R/versions.txt" "$R"/probe*.txt "$OUT/" 2>/dev/null
  tar czf "$OUT/sweep-records.tgz" -C "$R" --exclude='*.tgz' . 2>/dev/null
  (cd "$S/work" && find state -path '*locate*' -type f -size -8M | tar czf "$OUT/sweep-locate.tgz" -T - 2>/dev/null)
  ls -la "$OUT"
  ;;
*) sed -n '2,11p' "$0"; exit 2 ;;
esac
