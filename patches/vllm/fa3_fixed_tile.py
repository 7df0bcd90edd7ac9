"""FlashAttention 3 with one tile for decode, prefill and mixed batches.

vLLM's FA3 backend passes the batch's longest query (`max_seqlen_q`) to the kernel, whose heuristics pick the
query/key tile from it: a decode step (one query row per sequence) runs another tile, so another accumulation
order over the keys, than the prefill that scores the same rows. Measured on the H200 with vLLM 0.26.0
(head_dim 64, paged KV, 400 tokens): 272 of 400 decode rows differed from prefill; with `max_seqlen_q` raised
to at least 128 for every call, 0 of 400 (also a decode row inside a mixed batch). The kernel itself is kept;
only its launch is pinned. The ahead-of-time scheduler metadata was planned for the unpinned launch and the
split count grows with the batch under CUDA graphs, so both are fixed too (no metadata, one split). Cascade
attention (a shared-prefix fast path with another reduction) is switched off for the same reason.
"""

from __future__ import annotations

import functools

from tic.patches._swap import swap_hooks
from tic.patches.base import Patch

NAME = "fa3-fixed-tile"
MIN_TILE_Q = 128  # a max_seqlen_q at or above this selects FA3's prefill tile (measured: decode = prefill)
_BACKEND = "vllm.v1.attention.backends.flash_attn"


def _pin(fn):
    @functools.wraps(fn)
    def pinned(*args, **kwargs):
        if "max_seqlen_q" in kwargs:
            kwargs["max_seqlen_q"] = max(int(kwargs["max_seqlen_q"]), MIN_TILE_Q)
            kwargs["scheduler_metadata"] = None
            kwargs["num_splits"] = 1
        return fn(*args, **kwargs)
    return pinned


def _never(fn):
    @functools.wraps(fn)
    def never(*args, **kwargs):
        return False
    return never


PATCH = Patch(
    name=NAME, target="vllm", versions=">=0.26.0,<0.27", gate="C4",
    symptom="C4 (or C3) fails in self_attn.attn, first operator _vllm_fa3_C.fwd: one decode row vs the same "
            "sequence's prefill rows differ (often 1 ulp) once the context passes ~128 keys",
    fix="every FA3 varlen call is launched with max_seqlen_q >= 128, no AOT scheduler metadata and one split, so "
        "decode, prefill and mixed batches run one tile and one key order; cascade attention is off",
    guide="guides/C4.md",
    cost="the three patches together: 118-119 % of default vLLM's tokens/s on a Qwen3-1.7B-like model with CUDA "
         "graphs (H200, vLLM 0.26.0, docs/results/vllm-patches.md); this wrapper alone measured 96.6 % earlier",
    **swap_hooks(NAME, (_BACKEND, "flash_attn_varlen_func", _pin, _BACKEND),
                 (_BACKEND, "use_cascade_attention", _never, _BACKEND)),
)
