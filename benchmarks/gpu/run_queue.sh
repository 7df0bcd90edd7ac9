#!/usr/bin/env bash
# Device jobs in phases, in the background, so that a session's work outlives one device call (a machine idle
# for 30 s is given back: keep a `collect` call running while the queue works).
#   (device, after the vllm-bundle install; from the repository root)
#   bash benchmarks/gpu/run_queue.sh start 'JOB ;; JOB' 'JOB' ...
#        each argument is a phase: its jobs (separated by ' ;; ') run side by side, the phases one after another.
#        A JOB is a shell command run from the repository root with device_env.sh's environment,
#        TIC_GPU_WORK=$Q/pN-jobM and OUT=$Q/pN-jobM/out; its output goes to $Q/pN-jobM.log and its exit status
#        to $Q/pN-jobM.rc ($Q = $TIC_GPU_WORK/queue, emptied by start)
#   bash benchmarks/gpu/run_queue.sh collect [WAIT_S]
#        waits up to WAIT_S seconds for the queue to end (polling its files, never a process list), prints each
#        job's state and last lines, packs logs and outputs (no tensors or weights) into $OUT/queue.tgz
#   bash benchmarks/gpu/run_queue.sh skip [JOB_NAME ...]
#        stops the named running jobs (p1-job2 ...; none named: every running one) and all they started, by the
#        process group each job got at start (never a pattern, which can match the calling shell); its phase then
#        ends as usual and the next one starts. collect reports such a job as skipped.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
Q=$WORK/queue
cmd=${1:-}; shift || true
case "$cmd" in
start)
  [ $# -gt 0 ] || { echo "start needs at least one phase" >&2; exit 2; }
  rm -rf "$Q" && mkdir -p "$Q"
  script=$Q/queue.sh
  { echo "cd $(printf %q "$REPO")"; p=0
    for phase in "$@"; do
      p=$((p + 1)); j=0
      while IFS= read -r job; do
        job=$(echo "$job" | sed 's/^ *//; s/ *$//'); [ -n "$job" ] || continue
        j=$((j + 1)); name=p$p-job$j
        echo "printf '%s\n' $(printf %q "$job") > $Q/$name.cmd"
        # each job a process group of its own (setsid), its id in $name.pid: what skip stops
        echo "( (export TIC_GPU_WORK=$Q/$name OUT=$Q/$name/out; mkdir -p \"\$OUT\"; setsid -w bash -c $(printf %q "$job") & echo \$! > $Q/$name.pid; wait \$!) > $Q/$name.log 2>&1; echo \$? > $Q/$name.rc ) &"
      done < <(echo "$phase" | sed 's/ ;; /\n/g')
      echo "wait; touch $Q/p$p.done"
    done
    echo "touch $Q/done"; } > "$script"
  setsid nohup bash "$script" > "$Q/queue.log" 2>&1 < /dev/null &
  echo "queue started: $# phase(s), $(grep -c '^(' "$script") job(s), in $Q"
  ;;
collect)
  [ -d "$Q" ] || { echo "no queue in $Q (start one first)" >&2; exit 2; }
  end=$(( $(date +%s) + ${1:-0} ))
  while [ ! -f "$Q/done" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
  [ -f "$Q/done" ] && echo "queue finished" || echo "queue still running"
  for cmdfile in "$Q"/p*-job*.cmd; do
    [ -e "$cmdfile" ] || continue
    name=$(basename "$cmdfile" .cmd)
    state=$( [ -f "$Q/$name.rc" ] && echo "exit $(cat "$Q/$name.rc")" || echo "running" )
    [ -f "$Q/$name.skipped" ] && state="skipped, $state"
    echo "== $name ($state): $(cat "$cmdfile")"
    tail -n "${TAIL_LINES:-8}" "$Q/$name.log" 2>/dev/null | cut -c1-400
  done
  mkdir -p "$OUT"
  tar czf "$OUT/queue.tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' --exclude=cache \
    --exclude=pkg -C "$Q" . 2>/dev/null
  ;;
skip)
  [ -d "$Q" ] || { echo "no queue in $Q (start one first)" >&2; exit 2; }
  names=("$@")
  if [ ${#names[@]} -eq 0 ]; then
    for f in "$Q"/p*-job*.pid; do [ -e "$f" ] && names+=("$(basename "$f" .pid)"); done
  fi
  stopped=0
  for name in "${names[@]}"; do
    [ -f "$Q/$name.cmd" ] || { echo "no job $name in the queue" >&2; exit 2; }
    [ -f "$Q/$name.rc" ] && continue
    pid=$(cat "$Q/$name.pid" 2>/dev/null) || continue
    touch "$Q/$name.skipped"
    kill -TERM -- "-$pid" 2>/dev/null && stopped=$((stopped + 1))
  done
  echo "skipped $stopped running job(s)"
  ;;
*) sed -n '2,16p' "$0"; exit 2 ;;
esac
