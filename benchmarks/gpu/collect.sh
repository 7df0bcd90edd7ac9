#!/usr/bin/env bash
# Packs what device runs left under their work folders into one archive in $OUT (a call brings back few files, and
# the next call clears $OUT: collect within the call that waits for the runs).
#   bash benchmarks/gpu/collect.sh WORK_DIR ...     e.g. /tmp/g1 /tmp/g2 /tmp/sw
# Takes every res/, state/ and out/ folder below each WORK_DIR (records, logs, tables, locator reports), without
# tensors or weights, into $OUT/collect.tgz, and prints the verdict tables it finds.
set -uo pipefail
OUT=${OUT:?OUT is the folder the device tool brings back}
list=$(mktemp)
for w in "$@"; do
  find "$w" -type d \( -name res -o -name state -o -name out \) -prune -print 2>/dev/null
done | while read -r d; do
  find "$d" -type f ! -name '*.pt' ! -name '*.safetensors' ! -name '*.bin' -size -16M
done > "$list"
tar czf "$OUT/collect.tgz" -T "$list" 2>/dev/null
echo "collect.tgz: $(wc -l < "$list") files"
find "$@" -name verdicts.md -exec sh -c 'echo "== $1"; cat "$1"' _ {} \; 2>/dev/null
rm -f "$list"
