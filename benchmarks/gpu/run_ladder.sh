#!/usr/bin/env bash
# The whole ladder on the H200 (docs/results/ladder.md) and C7's planted backwards (training.md), in one device call.
#   (device, after the vllm-bundle install)  bash benchmarks/gpu/run_ladder.sh [LADDER_CONFIG ...]
# 1. each l-* config: C1 baseline measured, frozen and approved, then C0..C10 (drive.py), all in parallel;
# 2. C7 with planted wrong backwards on the dense and MoE models (c7_plants.py; SKIP_PLANTS=1 skips it);
# 3. default vs tic patches vs batch-invariant throughput, side by side (perf_sides.py; SKIP_PERF=1 skips it),
#    after the ladders. Works in $TIC_GPU_WORK/ladder; results (no tensors) in $OUT/ladder-results.tgz.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
W=$WORK/ladder; mkdir -p "$W/records" "$W/res"; cd "$W"
versions "$OUT/versions.txt"
names=${*:-l-dense-eager l-moe-eager l-dense-graph}
configs "$W" $names l-dense-graph
for n in $names; do
  TIC_LOCATE=${TIC_LOCATE:-0} timeout ${TIC_RUN_TIMEOUT:-480} python3 "$GPU/drive.py" "$n.yaml" "$W/res" --from C0 --to C10 --baseline-by "tic lead engineer (H200 device run)" > "$W/res/$n.log" 2>&1 &
done
[ -z "${SKIP_PLANTS:-}" ] && plants "$W" "$W/res" 300 dense moe
wait
if [ -z "${SKIP_PERF:-}" ]; then
  timeout ${PERF_TIMEOUT:-100} python3 "$GPU/perf_sides.py" l-dense-graph.yaml --repeats 3 --json "$W/res/perf-sides.json" > "$W/res/perf-sides.log" 2>&1
fi
python3 "$GPU/verdicts.py" "$W/res" $names --gates C0,C1,C2,C3,C4,C5,C6,C7,C8,C9,C10 --cell verdict | tee "$W/res/verdicts.md"
grep -h "^\[l-" "$W"/res/l-*.log | head -60
grep -h "Error\|Traceback" "$W"/res/l-*.log | sort | uniq -c | head -20
cat "$W"/res/c7-plants-*.log | grep "^|" ; grep -h "Error" "$W"/res/c7-plants-*.log | head -5
tail -8 "$W/res/perf-sides.log" 2>/dev/null
cp -r records "$W/res/" 2>/dev/null
tar czf "$OUT/ladder-results.tgz" --exclude='*.pt' --exclude='*.safetensors' --exclude='*.bin' -C "$W" res state 2>/dev/null
ls -la "$OUT"
