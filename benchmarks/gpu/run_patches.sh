#!/usr/bin/env bash
# tic's bundled vLLM patches on the H200 (docs/results/vllm-patches.md), each config with and without them in the
# same run.
#   (device, after the vllm-bundle install)  bash benchmarks/gpu/run_patches.sh [CONFIG_NAME|PATTERN ...]
# 1. the patches' minimal repros, stock then patched (exit 1 = differs, 0 = equal; SKIP_REPROS=1 skips 1 and 2);
# 2. `tic patch status` with TIC_PATCHES set: the patches as vLLM's plugin entry point applies them;
# 3. C3 and C4 of the given configs (e.g. 'p-*', 'a-*'; configs.py --list), all in parallel on the GPU; locator on
#    for patched eager configs only (a patched config that still fails is located); a table of the verdicts.
# Works in $TIC_GPU_WORK/patches; results (no tensors) in $OUT/patch-results.tgz.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
W=$WORK/patches; mkdir -p "$W/records" "$W/res"; cd "$W"
versions "$OUT/versions.txt"
if [ -z "${SKIP_REPROS:-}" ]; then
  python3 "$GPU/patch_repros.py" --json "$W/res/repros-stock.json" 2>&1 | grep -v Warning | tee "$W/res/repros.txt"; echo "rc=${PIPESTATUS[0]} stock" | tee -a "$W/res/repros.txt"
  python3 "$GPU/patch_repros.py" --patched --json "$W/res/repros-patched.json" 2>&1 | grep -v Warning | tee -a "$W/res/repros.txt"; echo "rc=${PIPESTATUS[0]} patched" | tee -a "$W/res/repros.txt"
  TIC_PATCHES=fa3-fixed-tile,rmsnorm-rows,gemm-fixed-order python3 -m tic.skill.cli patch status 2>&1 | tail -4 | tee "$W/res/patch-status.txt"; echo "rc=${PIPESTATUS[0]} patch status" | tee -a "$W/res/patch-status.txt"
fi
names=""
[ $# -gt 0 ] && names=$(python3 "$GPU/configs.py" --list "$@" | cut -d' ' -f1)
configs "$W" p-dense-eager-off p-moe-eager-off p-big-eager-off $names
pregenerate "$W" p-dense-eager-off p-moe-eager-off p-big-eager-off
for n in $names; do
  loc=0; case "$n" in *-eager-on|*-chunk-on|a-*) loc=1;; esac
  TIC_LOCATE=$loc timeout ${TIC_RUN_TIMEOUT:-400} python3 "$GPU/drive.py" "$n.yaml" "$W/res" --from C3 --to C4 > "$W/res/$n.log" 2>&1 &
done
wait
[ -n "$names" ] && python3 "$GPU/verdicts.py" "$W/res" $names --gates C3,C4 | tee "$W/res/verdicts.md"
grep -h "locate C\|Error\|error" "$W"/res/p-*.log | head -40
cp -r records "$W/res/" 2>/dev/null
tar czf "$OUT/patch-results.tgz" --exclude='*.pt' --exclude='*.safetensors' -C "$W" res state 2>/dev/null
ls -la "$OUT"
