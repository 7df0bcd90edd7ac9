#!/usr/bin/env bash
# Two H200s (docs/results/parallel.md): C0 and C5 of the moe4 model rolled out on several vLLM layouts against the
# one-GPU training forward on vLLM's kernels, all runs at once, each in a folder of its own:
#   x-moe4-ep1, x-moe4-ep1-slot     one GPU (without / with the moe-slot-order-sum patch)
#   x-moe4-dp2                      two independent replicas (DP=2, EP=1)
#   x-moe4-dp2ep2                   vLLM's DP=2 x EP=2 ranks with the slot-order merge patch
#   x-moe4-dp2ep2-stock             the same with vLLM's own EP merge (C0 refuses it; C5 measured anyway)
#   x-moe4-tp2                      TP=2: C0 refuses it; tp_c5.py runs C5's measure and judge on it
#   (device nvidia-h200-x2, after the vllm-bundle install)  bash benchmarks/gpu/run_parallel.sh [NAME ...]
# Works in $TIC_GPU_WORK/parallel; results in $OUT/parallel-results.tgz.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export VLLM_WORKER_MULTIPROC_METHOD=spawn
W=$WORK/parallel; mkdir -p "$W/res"
versions "$W/res/versions.txt"
names=${*:-x-moe4-ep1 x-moe4-ep1-slot x-moe4-dp2 x-moe4-dp2ep2 x-moe4-dp2ep2-stock x-moe4-tp2}
for n in $names; do
  d="$W/$n"; mkdir -p "$d/records"; configs "$d" "$n"
  (
    cd "$d"
    python3 -m tic.skill.cli gate C0 -c "$n.yaml" --json > "$W/res/$n-c0.json" 2> "$W/res/$n-c0.err"; echo "exit $?" >> "$W/res/$n-c0.err"
    if [ "$n" = x-moe4-tp2 ]; then
      timeout ${TIC_RUN_TIMEOUT:-480} python3 "$GPU/tp_c5.py" "$n.yaml" "$W/res/$n-c5.json" > "$W/res/$n-c5.log" 2>&1
    else
      timeout ${TIC_RUN_TIMEOUT:-480} python3 -m tic.skill.cli gate C5 -c "$n.yaml" --json > "$W/res/$n-c5.json" 2> "$W/res/$n-c5.log"
    fi
    echo "exit $?" >> "$W/res/$n-c5.log"
  ) &
done
wait
python3 "$GPU/verdicts.py" "$W/res" $names --gates C0,C5 --cell reason | tee "$W/res/verdicts.md"
for n in $names; do echo "== $n"; tail -3 "$W/res/$n-c5.log"; done
tar czf "$OUT/parallel-results.tgz" -C "$W" res $(cd "$W" && ls -d */state */records 2>/dev/null) 2>/dev/null
