#!/usr/bin/env bash
# Two H200s (docs/results/parallel.md section 1): what C0 says of a TP = 2 rollout, and C5 of that rollout against
# the one-GPU training forward on vLLM's kernels (the same model passes C5 at TP = 1: t-moe-eager).
#   (device nvidia-h200-x2, after the vllm-bundle install)  bash benchmarks/gpu/run_tp2.sh
# Works in $TIC_GPU_WORK/tp2; results in $OUT/tp2-results.tgz.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
W=$WORK/tp2; mkdir -p "$W/records" "$W/res"; cd "$W"
configs "$W" x-moe-tp2
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpus.txt"
python3 -m tic.skill.cli gate C0 -c x-moe-tp2.yaml > res/x-moe-tp2-c0.txt 2>&1; echo "C0 exit $?" >> res/x-moe-tp2-c0.txt
tail -5 res/x-moe-tp2-c0.txt
TIC_LOCATE=0 timeout ${TIC_RUN_TIMEOUT:-170} python3 "$GPU/drive.py" x-moe-tp2.yaml res --from C5 --to C5 > res/x-moe-tp2.log 2>&1
grep "^\[x-" res/x-moe-tp2.log; grep -h "Error" res/x-moe-tp2.log | tail -3
tar czf "$OUT/tp2-results.tgz" --exclude='*.pt' --exclude='*.safetensors' -C "$W" res state 2>/dev/null
