#!/usr/bin/env bash
# One device call on one H200 (after the vllm-bundle install):
#   1. the training-step bench at hidden 2048 with the three bundled patches (t-big-eager's shape), alone on the GPU
#      (docs/results/train-step.md section 7);
#   2. C5..C7 on dense, MoE, hidden-2048 and Llama (t-llama-eager: llama3 rope scaling, q/k/v/o bias, tied
#      embeddings) against the patched rollout (run_train.sh), and batch-invariant mode without and with
#      fa3-fixed-tile side by side (t-dense-bi, t-dense-bi-fa3) (docs/results/training.md section 6).
#   bash benchmarks/gpu/run_step_verify.sh      (outputs in $OUT)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
PP=fa3-fixed-tile,gemm-fixed-order,rmsnorm-rows
TIC_PATCHES=$PP timeout 170 python3 "$GPU/train_step_bench.py" --hidden 2048 --seq 1024 --repeats 5 \
  > "$OUT/step-h2048-patched.txt" 2>&1
TIC_RUN_TIMEOUT=${TIC_RUN_TIMEOUT:-380} bash "$GPU/run_train.sh" t-dense-eager t-moe-eager t-big-eager t-llama-eager t-dense-bi t-dense-bi-fa3 \
  > "$OUT/train.log" 2>&1
grep -h "ratio\|RESULT\|FAIL\|plain HF (\|tic on\|gemm-fixed-m" "$OUT/step-h2048-patched.txt" | cut -c1-600
tail -6 "$OUT/train.log"
