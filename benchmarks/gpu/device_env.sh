# Sourced by the device scripts (benchmarks/gpu/*.sh). Settings, from the environment:
#   TIC_GPU_WORK   the folder the scripts work in (default /tmp/tic-gpu): generated configs, records, state, logs,
#                  the model cache and the package link; each script works in a subfolder of its own
#   OUT            where the results to bring back go (default $TIC_GPU_WORK/out; the device tool sets its own)
#   TIC_VLLM_SITE  where the vLLM bundle is unpacked (default /tmp/site, where the vllm-bundle steps put it)
# Puts tic (this checkout, through $TIC_GPU_WORK/pkg/tic) and the bundle on the path, runs vLLM in-process and
# offline, and writes tic's vLLM plugin entry point as a dist-info beside vLLM (what `pip install tic-consistency`
# writes).
GPU=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$GPU/../.." && pwd)
WORK=${TIC_GPU_WORK:-/tmp/tic-gpu}
OUT=${OUT:-$WORK/out}
SITE=${TIC_VLLM_SITE:-/tmp/site}
mkdir -p "$WORK/pkg" "$OUT" && ln -sfn "$REPO" "$WORK/pkg/tic"
export PYTHONPATH=$SITE:$WORK/pkg${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export VLLM_ENABLE_V1_MULTIPROCESSING=0 TIC_CACHE=$WORK/cache HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
# vLLM's block-FP8 linears warm DeepGEMM up for every token count at engine start (1,175 JIT kernels, about a
# second each on the H200: longer than a device call); skip it, kernels then compile on first use
export VLLM_DEEP_GEMM_WARMUP=${VLLM_DEEP_GEMM_WARMUP:-skip}
if [ -d "$SITE" ]; then
  D=$SITE/tic_consistency-0.1.0.dist-info
  mkdir -p "$D"
  printf 'Metadata-Version: 2.1\nName: tic-consistency\nVersion: 0.1.0\n' > "$D/METADATA"
  printf '[vllm.general_plugins]\ntic_patches = tic.patches.plugin:load\n' > "$D/entry_points.txt"
fi

# versions FILE: the versions line of the run (vLLM, torch, transformers, triton, the GPUs), into FILE and stdout
versions() {
  python3 -c "import vllm, torch, transformers, triton; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, torch.cuda.device_count(), 'x', torch.cuda.get_device_name())" 2>&1 | tail -1 | tee "$1"
}

# configs DIR NAME|PATTERN ...: write DIR/NAME.yaml for each (benchmarks/gpu/configs.py --list names them)
configs() {
  python3 "$GPU/configs.py" "$@" > /dev/null
}

# pregenerate DIR NAME ...: generate the configs' model weights once, before runs in parallel would each start to
pregenerate() {
  local dir=$1; shift
  python3 - "$dir" "$@" <<'PY'
import sys
from pathlib import Path
from tic.config.schema import load_config
from tic.harness.model.generate import resolve_model_dir
for n in sys.argv[2:]:
    print(resolve_model_dir(load_config(Path(sys.argv[1]) / f"{n}.yaml")))
PY
}

# plants DIR RESDIR TIMEOUT MODEL ...: C7's control and planted wrong backwards (c7_plants.py) on each model's
# t-MODEL-eager config, in the background, in DIR; writes RESDIR/c7-plants-MODEL.json and .log (the caller waits)
plants() {
  local dir=$1 res=$2 limit=$3 m; shift 3
  for m in "$@"; do
    configs "$dir" "t-$m-eager"
    (cd "$dir" && timeout "$limit" python3 "$GPU/c7_plants.py" "t-$m-eager.yaml" "$res/c7-plants-$m.json" \
      > "$res/c7-plants-$m.log" 2>&1) &
  done
}

# previous_tree: a copy of this tree (without .carry) in which every file under .carry/prev/, at its path relative
# to the repository root, replaces the current one (made here with e.g.
# `mkdir -p .carry/prev && git archive REV patches/vllm/fa3_fixed_tile.py | tar x -C .carry/prev`); prints the
# import path (the bundle's site, then the copy's package link) a `previous` side or variant runs with
previous_tree() {
  local dir=$WORK/prev f
  [ -d "$REPO/.carry/prev" ] || { echo "no .carry/prev: nothing to run as previous" >&2; return 2; }
  rm -rf "$dir" && mkdir -p "$dir/pkg" "$dir/tree"
  tar -C "$REPO" --exclude=./.carry -cf - . | tar -C "$dir/tree" -xf -
  (cd "$REPO/.carry/prev" && find . -type f) | while read -r f; do
    mkdir -p "$(dirname "$dir/tree/$f")" && cp "$REPO/.carry/prev/$f" "$dir/tree/$f"
  done
  ln -sfn "$dir/tree" "$dir/pkg/tic"
  echo "$SITE:$dir/pkg"
}

# megatron_install: megatron-core from the wheels carried in .carry/megatron (fetched here with
# `pip download megatron-core==0.16.1 --no-deps --only-binary=:all: --python-version 3.X -d .carry/megatron`;
# name .carry/megatron in the run's carry), the one for the device's Python, into the bundle's site folder
megatron_install() {
  local tag whl
  tag=$(python3 -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  whl=$(ls "$REPO"/.carry/megatron/megatron_core-*-"$tag"-*.whl 2>/dev/null | head -1)
  [ -n "$whl" ] || { echo "no megatron-core wheel for $tag in .carry/megatron" >&2; return 2; }
  python3 -m pip install -q --no-deps --target "$SITE" "$whl"
}
