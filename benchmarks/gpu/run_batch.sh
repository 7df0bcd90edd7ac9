#!/usr/bin/env bash
# One device call, everything at once (docs/results/training.md section 4, parallel.md section 4), after the step
# benchmark ran alone:
#   run_train.sh on the dense/MoE configs and the batch-invariant pair (C5..C7, locator on),
#   C7 planted backwards on dense and MoE (c7_plants.py),
#   run_parallel.sh on the rank-locator and GPU-training-DP configs (needs two GPUs).
#   (device nvidia-h200-x2, after the vllm-bundle install)  bash benchmarks/gpu/run_batch.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
T=${TIC_RUN_TIMEOUT:-470}
TIC_RUN_TIMEOUT=$T bash "$GPU/run_train.sh" t-dense-eager t-moe-eager t-dense-bi t-dense-bi-stock > "$OUT/train.log" 2>&1 &
plants "$WORK/plants" "$OUT" "$T" dense moe
TIC_RUN_TIMEOUT=$T bash "$GPU/run_parallel.sh" x-moe4-dp2ep2-stock-locate x-moe4-dp2ep2-tdp2 > "$OUT/parallel.log" 2>&1 &
wait
tail -8 "$OUT/train.log"; for m in dense moe; do echo "== plants $m"; tail -12 "$OUT/c7-plants-$m.log"; done
tail -12 "$OUT/parallel.log"
