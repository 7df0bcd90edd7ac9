# Sourced by the device scripts: tic and the vLLM bundle on the path, vLLM in-process, no hub, outputs to $OUT;
# tic's vLLM plugin entry point as a dist-info beside vLLM (what `pip install tic-consistency` writes).
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-/tmp/tic-out}
mkdir -p /tmp/pkg "$OUT" && ln -sfn "$REPO" /tmp/pkg/tic
export PYTHONPATH=/tmp/site:/tmp/pkg${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export VLLM_ENABLE_V1_MULTIPROCESSING=0 TIC_CACHE=/tmp/tic-cache HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
D=/tmp/site/tic_consistency-0.1.0.dist-info
if [ -d /tmp/site ]; then
  mkdir -p "$D"
  printf 'Metadata-Version: 2.1\nName: tic-consistency\nVersion: 0.1.0\n' > "$D/METADATA"
  printf '[vllm.general_plugins]\ntic_patches = tic.patches.plugin:load\n' > "$D/entry_points.txt"
fi
