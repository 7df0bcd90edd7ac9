#!/usr/bin/env bash
# Several device jobs side by side on the GPU, each in a work folder and result folder of its own:
#   (device, after the vllm-bundle install)  bash benchmarks/gpu/run_jobs.sh 'JOB' 'JOB' ...
# A JOB is a shell command run from the repository root with the environment of device_env.sh set first
# (PYTHONPATH with tic and the bundle), TIC_GPU_WORK=/tmp/job<N> and OUT=$OUT/job<N>; its output goes to
# $OUT/job<N>.log. The script waits for every job, then prints each log's last lines. Example:
#   bash benchmarks/gpu/run_jobs.sh 'FROM=C2 TO=C7 bash benchmarks/gpu/run_train.sh f-dense-eager' \
#     'python3 benchmarks/gpu/shape_sweep.py run /tmp/sw $OUT/sw --shapes Qwen3-8B --modes eager --variants fp8'
# (Environment first, then the jobs in the background: a job started before the environment is set finds neither
# tic nor vLLM.)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
cd "$REPO"
n=0
for job in "$@"; do
  n=$((n + 1))
  mkdir -p "$OUT/job$n"
  (export TIC_GPU_WORK=/tmp/job$n OUT=$OUT/job$n; bash -c "$job") > "$OUT/job$n.log" 2>&1 &
done
wait
for i in $(seq 1 "$n"); do
  echo "== job$i: ${!i}"
  tail -n "${TAIL_LINES:-15}" "$OUT/job$i.log" | cut -c1-400
done
