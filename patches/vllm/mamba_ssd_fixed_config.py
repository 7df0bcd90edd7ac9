"""Mamba-2's chunked scan (SSD) on one fixed Triton config in every process.

vLLM's SSD kernels (ssd_chunk_state, ssd_bmm, ssd_chunk_scan, ssd_state_passing) are `triton.autotune`d: each
process times a list of tile configs on its first call and keeps the fastest. The tiles over a chunk's positions
and over the state size are reduction tiles, so two processes (the rollout's engine and the training forward on
vLLM's kernels, or two rollout replicas) that time differently sum a chunk in different orders. This patch leaves
each autotuner one config, the first of its list (vLLM's own list, which it may pick for any shape the key
serves), and drops what it had tuned, so every process runs the same tiles without timing anything.
"""

from __future__ import annotations

import importlib

from tic.patches.base import Patch

NAME = "mamba-ssd-fixed-config"
_OPS = "vllm.model_executor.layers.mamba.ops"
KERNELS = (  # (module, autotuned kernel) of vLLM 0.26's chunked scan
    (f"{_OPS}.ssd_chunk_state", "_chunk_cumsum_fwd_kernel"),
    (f"{_OPS}.ssd_chunk_state", "_chunk_state_fwd_kernel"),
    (f"{_OPS}.ssd_bmm", "_bmm_chunk_fwd_kernel"),
    (f"{_OPS}.ssd_state_passing", "_state_passing_fwd_kernel"),
    (f"{_OPS}.ssd_chunk_scan", "_chunk_scan_fwd_kernel"),
)
_MARK = "_tic_configs"  # the autotuner's own config list, kept while pinned


def _tuners():
    for home, attr in KERNELS:
        tuner = getattr(importlib.import_module(home), attr)
        if not isinstance(getattr(tuner, "configs", None), list):
            raise RuntimeError(f"patch {NAME}: {home}.{attr} is not an autotuned kernel in this vLLM")
        yield tuner


def _apply() -> None:
    for tuner in _tuners():
        if not hasattr(tuner, _MARK):
            setattr(tuner, _MARK, tuner.configs)
            tuner.configs = tuner.configs[:1]
            tuner.cache.clear()


def _revert() -> None:
    for tuner in _tuners():
        if hasattr(tuner, _MARK):
            tuner.configs = getattr(tuner, _MARK)
            delattr(tuner, _MARK)
            tuner.cache.clear()


def _is_applied() -> bool:
    try:
        return all(hasattr(t, _MARK) and len(t.configs) == 1 for t in _tuners())
    except (ImportError, AttributeError, RuntimeError):
        return False


PATCH = Patch(
    name=NAME, target="vllm", versions=">=0.26.0,<0.27", gate="C5",
    symptom="C5 (or C3 between rollout replicas) fails in a Mamba-2 mixer (mixer, the chunked scan's kernels "
            "_chunk_scan_fwd / _chunk_state_fwd / _bmm_chunk_fwd) while C3 and C4 within one process pass: the two "
            "processes' autotuners picked different tiles",
    fix="each autotuned SSD kernel keeps only the first config of its list (its tuned choices dropped), so every "
        "process sums a chunk on the same tiles",
    guide="guides/ops/recurrent-layers.md",
    cost="not measured: the first config (32 x 32 x 32 for the scan, 128 x 256 x 64 for the C.B product) may be "
         "slower than the tuned choice on a long prefill (and in mamba-decode-replay's decode, which runs them)",
    _apply=_apply, _revert=_revert, _is_applied=_is_applied,
)
