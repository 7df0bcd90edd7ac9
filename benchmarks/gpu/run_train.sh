#!/usr/bin/env bash
# Training side on vLLM's kernels against the patched vLLM rollout (issue 10), and cuts loading in vLLM (issue 14).
#   (device, after the vllm-bundle install)  bash benchmarks/gpu/run_train.sh [CONFIG_NAME ...]
# 1. C5..C7 of each t-* config (patch_matrix.py), all in parallel on the GPU, locator on: a failing C5/C6 is
#    located to layer, module and operator with a repro;
# 2. with CUT_LOAD=1, cut_load.py: tic cut of dense, MoE and hybrid models, each cut loaded in vLLM;
# then a table of verdicts. Results (no tensors) in $OUT/train-results.tgz.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
W=/tmp/tic-work; mkdir -p "$W"; cp -r "$REPO/benchmarks/gpu/." "$W/"; cd "$W"; mkdir -p records res
python3 -c "import vllm, torch, transformers, triton; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | tail -1 | tee "$OUT/versions.txt"
names=${*:-t-dense-eager t-moe-eager t-big-eager}
FROM=${FROM:-C5}; TO=${TO:-C7}
for n in $names; do
  TIC_LOCATE=${TIC_LOCATE:-1} timeout ${TIC_RUN_TIMEOUT:-420} python3 drive.py "$n.yaml" "$W/res" --from "$FROM" --to "$TO" > "$W/res/$n.log" 2>&1 &
done
if [ -n "${CUT_LOAD:-}" ]; then
  timeout ${TIC_RUN_TIMEOUT:-420} python3 cut_load.py "$W/cutload" ${CUT_NAMES:-} > "$W/res/cut-load.log" 2>&1 &
fi
wait
python3 - $names <<'PY' | tee "$W/res/verdicts.md"
import json, sys
from pathlib import Path
gates = ["C5", "C6", "C7"]
print("| config | " + " | ".join(gates) + " |\n|---|" + "---|" * len(gates))
for n in sys.argv[1:]:
    p = Path("res") / f"{n}-ladder.json"
    r = {x["gate"]: x for x in json.loads(p.read_text())["results"]} if p.exists() else {}
    cell = lambda g: f"{r[g]['verdict']} {r[g]['key_figure']}" if g in r else "not run (see log)"
    print(f"| {n} | " + " | ".join(cell(g) for g in gates) + " |")
PY
grep -h "locate C\|Error\|error\|Traceback" "$W"/res/t-*.log | head -40
[ -f "$W/res/cut-load.log" ] && tail -12 "$W/res/cut-load.log" && cp "$W/cutload/cut-load.json" "$W/res/" 2>/dev/null
cp -r records "$W/res/" 2>/dev/null
tar czf "$OUT/train-results.tgz" --exclude='*.pt' --exclude='*.safetensors' -C "$W" res state 2>/dev/null
ls -la "$OUT"
