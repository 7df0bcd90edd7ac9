#!/usr/bin/env bash
# Training side on vLLM's kernels against the patched vLLM rollout (docs/results/training.md), and cuts loading in
# vLLM (docs/results/cut.md).
#   (device, after the vllm-bundle install)  bash benchmarks/gpu/run_train.sh [CONFIG_NAME ...]
# 1. C$FROM..C$TO (default C5..C7) of each t-* config (drive.py), all in parallel on the GPU, locator on
#    (TIC_LOCATE=0 turns it off): a failing C5/C6 is located to layer, module and operator with a repro;
# 2. with CUT_LOAD=1, cut_load.py: tic cut of dense, MoE and hybrid models (CUT_NAMES), each cut loaded in vLLM;
# then a table of verdicts. Works in $TIC_GPU_WORK/train; results (no tensors) in $OUT/train-results.tgz.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
W=$WORK/train; mkdir -p "$W/records" "$W/res"; cd "$W"
versions "$OUT/versions.txt"
names=${*:-t-dense-eager t-moe-eager t-big-eager}
configs "$W" $names
case " $names " in *" m-"*) megatron_install || exit 2 ;; esac  # the Megatron trainer's configs: its wheel first
FROM=${FROM:-C5}; TO=${TO:-C7}
for n in $names; do
  TIC_LOCATE=${TIC_LOCATE:-1} timeout ${TIC_RUN_TIMEOUT:-420} python3 "$GPU/drive.py" "$n.yaml" "$W/res" --from "$FROM" --to "$TO" > "$W/res/$n.log" 2>&1 &
done
if [ -n "${CUT_LOAD:-}" ]; then
  timeout ${TIC_RUN_TIMEOUT:-420} python3 "$GPU/cut_load.py" "$W/cutload" ${CUT_NAMES:-} > "$W/res/cut-load.log" 2>&1 &
fi
wait
gates=$(python3 -c "import sys; a, b = (int(g[1:]) for g in sys.argv[1:]); print(','.join(f'C{i}' for i in range(a, b + 1)))" "$FROM" "$TO")
python3 "$GPU/verdicts.py" "$W/res" $names --gates "$gates" | tee "$W/res/verdicts.md"
grep -h "locate C\|Error\|error\|Traceback" "$W"/res/*.log | head -40
[ -f "$W/res/cut-load.log" ] && tail -12 "$W/res/cut-load.log" && cp "$W/cutload/cut-load.json" "$W/res/" 2>/dev/null
cp -r records "$W/res/" 2>/dev/null
tar czf "$OUT/train-results.tgz" --exclude='*.pt' --exclude='*.safetensors' -C "$W" res state 2>/dev/null
ls -la "$OUT"
