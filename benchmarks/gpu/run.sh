#!/usr/bin/env bash
# Run the vLLM ladder configs on the H200 and put records, ladder JSON, captures and logs into $OUT.
#   (device, after the vllm-bundle install)  bash benchmarks/gpu/run.sh [CONFIG_NAME ...]
# Default: every config below, all in parallel on the one GPU (each engine takes a fixed 512 MiB KV cache, so
# none of them profiles memory while another starts). The ladder runs the locator on each failing C3/C4/C5;
# each repro it kept is run once more here in a fresh process (repro-check.txt).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
W=/tmp/tic-work; rm -rf "$W"; cp -r "$REPO/benchmarks/gpu" "$W"; cd "$W"; mkdir -p records
python3 -c "import vllm, torch, transformers, tic; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" 2>&1 | tail -1 | tee "$OUT/versions.txt"
names=${*:-dense-default dense-bi moe-default moe-bi dense-chunk64 big-default big-bi big-graph}
# generate the two models' weights once, before the parallel runs
python3 -c "
from tic.config.schema import load_config; from tic.harness.model.generate import resolve_model_dir
for n in ['dense-default','moe-default','big-default']: print(resolve_model_dir(load_config(n+'.yaml')))"
for n in $names; do
  timeout ${TIC_RUN_TIMEOUT:-430} python3 drive.py "$n.yaml" "$W/res" > "$W/res-$n.log" 2>&1 &
done
wait
grep -h "^\[" "$W"/res-*.log; tail -n 5 "$W"/res-*.log
cp -r records "$W/res/"
python3 check.py "$W/res" $names | tee "$W/res/check.md"
cp "$W"/res-*.log "$W/res/"
for f in $(find "$W/state" -name repro.py | sort); do
  (cd "$(dirname "$f")" && timeout 60 python3 repro.py; echo "rc=$? $f") 2>&1 | tail -2
done | tee "$W/res/repro-check.txt"
tar czf "$OUT/vllm-h200-results.tgz" --exclude='*.pt' --exclude='*.safetensors' -C "$W" res state
ls -la "$OUT"
