"""The Triton fused-MoE kernel on one tile config for every batch size.

vLLM picks the fused-MoE kernel's tiles from the step's token count M (`try_get_optimal_moe_config`: the entry of
a tuned table nearest to M, else `get_default_config(M, ...)`). For block-FP8 weights the default changes at
M = 64 (BLOCK_SIZE_M 16 -> 64), and on Hopper a BLOCK_SIZE_M under 64 also switches the kernel to its swap-AB form
(`enable_swap_ab`), which multiplies B x A and transposes the result: the same expert GEMM in a different order.
A decode step of a few tokens and the prefill or training forward over many therefore score one token through
different kernels. This patch answers every call with the config vLLM itself chooses for a prefill-sized step
(PINNED_TOKENS), whatever the real M: one set of tiles, no swap-AB, in every process that applies it.
"""

from __future__ import annotations

from tic.patches._swap import swap_hooks
from tic.patches.base import Patch

NAME = "moe-fixed-config"
_HOME = "vllm.model_executor.layers.fused_moe.fused_moe"
# the step size whose config every call gets: above every threshold of vLLM's default rule (64 for block FP8,
# 512 for the others) and at the top of its tuned tables, so a prefill keeps the tiles it would have had
PINNED_TOKENS = 4096


def _pinned(original):
    def try_get_optimal_moe_config(w1_shape, w2_shape, top_k, dtype, M, block_shape=None):
        return original(w1_shape, w2_shape, top_k, dtype, PINNED_TOKENS, block_shape=block_shape)
    return try_get_optimal_moe_config


PATCH = Patch(
    name=NAME, target="vllm", versions=">=0.26.0,<0.27", gate="C4",
    symptom="C4 or C5 fails in a MoE block's experts (the locator names fused_moe_kernel) on block-FP8 (or tuned) "
            "experts while the dense layers pass: decode steps of up to 64 tokens run other tiles (and on Hopper "
            "the swap-AB kernel) than prefill and the training forward",
    fix="every fused-MoE call gets the tile config vLLM picks for a 4096-token step, whatever the step's size",
    guide="guides/ops/moe-expert-gemm.md",
    cost="decode steps run prefill's larger M tile (each expert's few tokens padded to it); not yet measured",
    **swap_hooks(NAME, (_HOME, "try_get_optimal_moe_config", _pinned, "vllm.")),
)
