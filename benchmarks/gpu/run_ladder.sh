#!/usr/bin/env bash
# The whole ladder on the H200 (issue 15) and the training-side GPU checks (issue 10), in one device call.
#   (device, after the vllm-bundle install)  bash benchmarks/gpu/run_ladder.sh [LADDER_CONFIG ...]
# 1. each l-* config (patch_matrix.py): C1 baseline measured, frozen and approved, then C0..C10, in parallel;
# 2. C7 with planted wrong backwards on the dense and MoE models (c7_plants.py);
# 3. default vs tic patches vs batch-invariant throughput, side by side (perf_sides.py), after the ladders;
# 4. the training-step benchmark on the MoE model. Results (no tensors) in $OUT/ladder-results.tgz.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
W=/tmp/tic-work; mkdir -p "$W"; cp -r "$REPO/benchmarks/gpu/." "$W/"; cd "$W"; mkdir -p records res
python3 -c "import vllm, torch, transformers, triton; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | tail -1 | tee "$OUT/versions.txt"
names=${*:-l-dense-eager l-moe-eager l-dense-graph}
for n in $names; do
  TIC_LOCATE=${TIC_LOCATE:-0} timeout ${TIC_RUN_TIMEOUT:-480} python3 drive.py "$n.yaml" "$W/res" --from C0 --to C10 --baseline-by "tic lead engineer (H200 device run)" > "$W/res/$n.log" 2>&1 &
done
if [ -z "${SKIP_PLANTS:-}" ]; then
  for m in dense moe; do
    timeout 300 python3 c7_plants.py "t-$m-eager.yaml" "$W/res/c7-plants-$m.json" > "$W/res/c7-plants-$m.log" 2>&1 &
  done
fi
wait
if [ -z "${SKIP_PERF:-}" ]; then
  timeout ${PERF_TIMEOUT:-100} python3 perf_sides.py l-dense-graph.yaml --repeats 3 --json "$W/res/perf-sides.json" > "$W/res/perf-sides.log" 2>&1
fi
python3 - $names <<'PY' | tee "$W/res/verdicts.md"
import json, sys
from pathlib import Path
gates = [f"C{i}" for i in range(11)]
print("| config | " + " | ".join(gates) + " |\n|---|" + "---|" * len(gates))
for n in sys.argv[1:]:
    p = Path("res") / f"{n}-ladder.json"
    r = {x["gate"]: x for x in json.loads(p.read_text())["results"]} if p.exists() else {}
    print(f"| {n} | " + " | ".join(r[g]["verdict"] if g in r else "-" for g in gates) + " |")
PY
grep -h "^\[l-" "$W"/res/l-*.log | head -60
grep -h "Error\|Traceback" "$W"/res/l-*.log | sort | uniq -c | head -20
cat "$W"/res/c7-plants-*.log | grep "^|" ; grep -h "Error" "$W"/res/c7-plants-*.log | head -5
tail -8 "$W/res/perf-sides.log" 2>/dev/null
cp -r records "$W/res/" 2>/dev/null
tar czf "$OUT/ladder-results.tgz" --exclude='*.pt' --exclude='*.safetensors' --exclude='*.bin' -C "$W" res state 2>/dev/null
ls -la "$OUT"
