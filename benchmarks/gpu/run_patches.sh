#!/usr/bin/env bash
# Measure tic's bundled vLLM patches on the H200, each config with and without them in the same run.
#   (device, after the vllm-bundle install)  bash benchmarks/gpu/run_patches.sh [CONFIG_NAME ...]
# 1. the patches' minimal repros, stock then patched (exit 1 = differs, 0 = equal);
# 2. `tic patch status` with TIC_PATCHES set: the patches as vLLM's plugin entry point applies them;
# 3. C3 and C4 of the given configs (patch_matrix.py), all in parallel on the GPU; locator on for patched
#    eager configs only (a patched config that still fails is located); a table of the verdicts.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
W=/tmp/tic-work; mkdir -p "$W"; cp -r "$REPO/benchmarks/gpu/." "$W/"; cd "$W"; mkdir -p records res
python3 -c "import vllm, torch, transformers, triton; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | tail -1 | tee "$OUT/versions.txt"
if [ -z "${SKIP_REPROS:-}" ]; then
  python3 patch_repros.py --json "$W/res/repros-stock.json" 2>&1 | grep -v Warning | tee "$W/res/repros.txt"; echo "rc=${PIPESTATUS[0]} stock" | tee -a "$W/res/repros.txt"
  python3 patch_repros.py --patched --json "$W/res/repros-patched.json" 2>&1 | grep -v Warning | tee -a "$W/res/repros.txt"; echo "rc=${PIPESTATUS[0]} patched" | tee -a "$W/res/repros.txt"
  TIC_PATCHES=fa3-fixed-tile,rmsnorm-fixed-block,gemm-fixed-m python3 -m tic.skill.cli patch status 2>&1 | tail -4 | tee "$W/res/patch-status.txt"; echo "rc=${PIPESTATUS[0]} patch status" | tee -a "$W/res/patch-status.txt"
fi
names=${*:-}
python3 -c "
from tic.config.schema import load_config; from tic.harness.model.generate import resolve_model_dir
for n in ['p-dense-eager-off','p-moe-eager-off','p-big-eager-off']: print(resolve_model_dir(load_config(n+'.yaml')))"
for n in $names; do
  loc=0; case "$n" in *-eager-on|*-chunk-on|a-*) loc=1;; esac
  TIC_LOCATE=$loc timeout ${TIC_RUN_TIMEOUT:-400} python3 drive.py "$n.yaml" "$W/res" --from C3 --to C4 > "$W/res/$n.log" 2>&1 &
done
wait
python3 - $names <<'PY' | tee "$W/res/verdicts.md"
import json, sys
from pathlib import Path
print("| config | C3 | C4 |\n|---|---|---|")
for n in sys.argv[1:]:
    p = Path("res") / f"{n}-ladder.json"
    r = {x["gate"]: x for x in json.loads(p.read_text())["results"]} if p.exists() else {}
    cell = lambda g: f"{r[g]['verdict']} {r[g]['key_figure']}" if g in r else "not run (see log)"
    print(f"| {n} | {cell('C3')} | {cell('C4')} |")
PY
grep -h "locate C\|Error\|error" "$W"/res/p-*.log | head -40
cp -r records "$W/res/" 2>/dev/null
tar czf "$OUT/patch-results.tgz" --exclude='*.pt' --exclude='*.safetensors' -C "$W" res state 2>/dev/null
ls -la "$OUT"
