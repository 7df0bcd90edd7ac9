#!/usr/bin/env bash
# One device call on one H200 (after the vllm-bundle install), docs/results/training.md's locator and plant runs:
#   1. t-dense-bi-locate: C5 fails with vLLM's kernels on both sides (batch-invariant rollout without
#      fa3-fixed-tile); the locator must name the layer, module and operator and emit a repro that fails;
#   2. C7 planted wrong backwards on dense, MoE and Llama with the current code (c7_plants.py).
#   bash benchmarks/gpu/run_locate_plants.sh      (outputs in $OUT; works in $TIC_GPU_WORK/train and /plants)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
T=${TIC_RUN_TIMEOUT:-480}
TIC_RUN_TIMEOUT=$T FROM=C5 TO=C5 bash "$GPU/run_train.sh" t-dense-bi-locate > "$OUT/train.log" 2>&1 &
plants "$WORK/plants" "$OUT" "$T" dense moe llama
wait
cp -r "$WORK/train/state/t-dense-bi-locate/artifacts" "$OUT/locate-artifacts" 2>/dev/null
tail -8 "$OUT/train.log"; for m in dense moe llama; do echo "== plants $m"; tail -12 "$OUT/c7-plants-$m.log"; done
