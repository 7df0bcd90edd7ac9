#!/usr/bin/env bash
# One device call on one H200 (after the vllm-bundle install), issue 10's last checks:
#   1. t-dense-bi-locate: C5 fails with vLLM's kernels on both sides (batch-invariant rollout without
#      fa3-fixed-tile); the locator must name the layer, module and operator and emit a repro that fails;
#   2. C7 planted wrong backwards on dense, MoE and Llama with the current code (c7_plants.py).
#   bash benchmarks/gpu/run_locate_plants.sh      (outputs in $OUT)
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/device_env.sh"
T=${TIC_RUN_TIMEOUT:-480}
P=/tmp/tic-plants; mkdir -p "$P"; cp -r "$HERE/." "$P/"
TIC_RUN_TIMEOUT=$T FROM=C5 TO=C5 bash "$HERE/run_train.sh" t-dense-bi-locate > "$OUT/train.log" 2>&1 &
for m in dense moe llama; do
  (cd "$P" && timeout "$T" python3 c7_plants.py "t-$m-eager.yaml" "$OUT/c7-plants-$m.json" > "$OUT/c7-plants-$m.log" 2>&1) &
done
wait
cp -r /tmp/tic-work/state/t-dense-bi-locate/artifacts "$OUT/locate-artifacts" 2>/dev/null
tail -8 "$OUT/train.log"; for m in dense moe llama; do echo "== plants $m"; tail -12 "$OUT/c7-plants-$m.log"; done
