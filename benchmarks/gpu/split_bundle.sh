#!/usr/bin/env bash
# Re-split the vLLM bundle into chunks that fit a device call beside this working tree: a `run` call carries
# 64 MiB in all, the tree (tracked and untracked, not ignored) and every carried path included. vllm-bundle's own
# 55 MiB chunks leave too little room once the tree passes 9 MiB.
#   ../shared/device/vllm-bundle build .carry/vs      # once per machine (downloads, packs)
#   bash benchmarks/gpu/split_bundle.sh [.carry/vs] [RESERVE_MIB]
# RESERVE_MIB: what the last call carries besides (default 3: the Megatron wheel in .carry/megatron). Prints the
# device calls that move the chunks and unpack them into /tmp/site.
set -euo pipefail
dir=${1:-.carry/vs}
reserve=${2:-3}
ls "$dir"/c*/part.* > /dev/null 2>&1 || { echo "no bundle chunks under $dir (run vllm-bundle build $dir)" >&2; exit 2; }
tree_mib=$(( ( $(git ls-files -z --cached --others --exclude-standard | xargs -0 cat 2>/dev/null | wc -c) >> 20 ) + 1 ))
limit=$(( 64 - tree_mib - reserve - 1 ))
[ "$limit" -ge 8 ] || { echo "the tree takes $tree_mib MiB: too little room for chunks" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat "$dir"/c*/part.* > "$work/site.tar.xz"
total=$(stat -c %s "$work/site.tar.xz")
calls=$(( (total + (limit << 20) - 1) / (limit << 20) ))
chunk=$(( (total + calls - 1) / calls ))  # as few calls as fit, the bytes shared evenly
rm -rf "$dir"/c*
(cd "$work" && split -b "$chunk" -d -a 1 site.tar.xz part.)
i=0
for p in "$work"/part.*; do mkdir -p "$dir/c$i"; mv "$p" "$dir/c$i/part.$i"; i=$((i + 1)); done
last=$((i - 1))
echo "tree $tree_mib MiB, $i chunks of $(( chunk >> 20 )) MiB" >&2
for n in $(seq 0 $((last - 1))); do
  echo "run carry=[\"$dir/c$n\"]  command: mkdir -p /tmp/acc && cp $dir/c$n/* /tmp/acc/"
done
echo "run carry=[\"$dir/c$last\", \".carry/megatron\"]  command: mkdir -p /tmp/acc && cp $dir/c$last/* /tmp/acc/ &&" \
  "(cd /tmp && cat acc/part.* | xz -d -T0 | tar x) || exit 3; export PYTHONPATH=/tmp/site && <queue start; collect>"
