#!/usr/bin/env bash
# The first vLLM-vs-HF runs (docs/results/vllm-rollout.md): the ladder C0..C5 of each config (drive.py), all in
# parallel on the one GPU (each engine takes a fixed 512 MiB KV cache, so none of them profiles memory while another
# starts). The ladder runs the locator on each failing C3/C4/C5; each repro it kept is run once more here in a
# fresh process (repro-check.txt); check.py recomputes every figure from the raw records (check.md).
#   (device, after the vllm-bundle install)  bash benchmarks/gpu/run.sh [CONFIG_NAME ...]
# Works in $TIC_GPU_WORK/run (emptied first); results (no tensors) in $OUT/vllm-h200-results.tgz.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
W=$WORK/run; rm -rf "$W"; mkdir -p "$W/res" "$W/records"; cd "$W"
versions "$OUT/versions.txt"
names=${*:-dense-default dense-bi moe-default moe-bi dense-chunk64 big-default big-bi big-graph}
configs "$W" $names dense-default moe-default big-default
pregenerate "$W" dense-default moe-default big-default
for n in $names; do
  timeout ${TIC_RUN_TIMEOUT:-430} python3 "$GPU/drive.py" "$n.yaml" "$W/res" > "$W/res-$n.log" 2>&1 &
done
wait
grep -h "^\[" "$W"/res-*.log; tail -n 5 "$W"/res-*.log
cp -r records "$W/res/"
python3 "$GPU/check.py" "$W/res" $names | tee "$W/res/check.md"
cp "$W"/res-*.log "$W/res/"
for f in $(find "$W/state" -name repro.py | sort); do
  (cd "$(dirname "$f")" && timeout 60 python3 repro.py; echo "rc=$? $f") 2>&1 | tail -2
done | tee "$W/res/repro-check.txt"
tar czf "$OUT/vllm-h200-results.tgz" --exclude='*.pt' --exclude='*.safetensors' -C "$W" res state
ls -la "$OUT"
