"""Megatron-core's MoE combine as one float32 sum per token in top-k slot order, whatever the expert layout.

Megatron-core 0.16's token dispatchers end with `moe_utils.unpermute`: each expert's output rows (expert-major,
`sorted_indices` naming each row's token) are scaled by their routing probability and added into the token's
row with `scatter_add_` (or `index_add_` in deterministic mode), in the model dtype. The addition order is
therefore the experts' order in the permuted buffer (expert index order, and on a GPU scatter_add's atomics:
run to run), not the order vLLM's rollout merges a token's top-k slots in, and each partial sum is rounded in
bf16. A training recompute then differs from the rollout in the merge even where every expert GEMM agrees
(method 4.5: the outputs return to the token and are summed there in float32 in slot order).

The patch replaces `unpermute` for the unfused, undropped path: per token, the slots in top-k order (routing
probability descending, ties to the lower expert id, the order torch.topk returns distinct values in), each
expert row times its probability in float32, added from +0 in that order and rounded once to the tokens' dtype.
The fused (Transformer Engine) and drop-and-pad paths keep their own kernels and are refused while the patch is
active: a silent fallback would reintroduce the order the patch removes.
"""

from __future__ import annotations

from tic.patches._swap import swap_hooks
from tic.patches.base import Patch

NAME = "megatron-moe-slot-order-combine"
_HOME = "megatron.core.transformer.moe.moe_utils"


def slot_order_combine(permuted_tokens, sorted_indices, restore_shape, probs, routing_map):
    """out[t] = dtype rounding of sum over t's slots s (top-k order) of float32(row(t, e_s)) * float32(p[t, e_s])."""
    import torch

    tokens, experts = routing_map.shape
    hidden = restore_shape[-1]
    mask = routing_map.bool()
    # row of the permuted buffer holding (token, expert): the buffer is expert-major, tokens ascending
    row_of = torch.full((experts, tokens), -1, dtype=torch.long, device=mask.device)
    row_of[mask.T] = torch.arange(int(mask.sum()), device=mask.device)
    if not torch.equal(mask.T.nonzero()[:, 1], sorted_indices.to(mask.device).long()):
        raise RuntimeError(f"{NAME}: the permuted buffer is not in routing_map's expert-major order")
    row_of = row_of.T
    k = int(mask.sum(1).max()) if tokens else 0
    key = torch.where(mask, probs.float(), torch.full_like(probs, float("-inf"), dtype=torch.float32))
    slots = torch.argsort(key, dim=1, descending=True, stable=True)[:, :k]
    acc = torch.zeros((tokens, hidden), dtype=torch.float32, device=permuted_tokens.device)
    t = torch.arange(tokens, device=mask.device)
    for s in range(k):
        e = slots[:, s]
        valid = mask[t, e]
        rows = permuted_tokens[row_of[t, e].clamp(min=0)].float() * probs[t, e].float()[:, None]
        acc += torch.where(valid[:, None], rows, torch.zeros((), dtype=torch.float32, device=acc.device))
    return acc.to(permuted_tokens.dtype)


def _make(original):
    def unpermute(permuted_tokens, sorted_indices, restore_shape, probs=None, routing_map=None, fused=False,
                  drop_and_pad=False):
        if probs is None:  # no merge weights: a pure gather back, one row per token and expert (no sum to order)
            return original(permuted_tokens, sorted_indices, restore_shape, probs, routing_map, fused, drop_and_pad)
        if fused or drop_and_pad:
            raise RuntimeError(f"{NAME}: the fused and drop-and-pad unpermute paths are not covered; set "
                               "moe_permute_fusion=False and no expert capacity")
        return slot_order_combine(permuted_tokens, sorted_indices, restore_shape, probs, routing_map)
    return unpermute


PATCH = Patch(
    name=NAME, target="megatron-core", module="megatron.core", engine="megatron", versions=">=0.16.0,<0.17",
    gate="C5",
    symptom="C5 or C6 fails in a MoE layer (mlp / experts, the token combine after the expert GEMMs) of a Megatron "
            "trainer while every expert GEMM agrees: Megatron adds a token's expert outputs in expert order in "
            "the model dtype (scatter_add), the rollout in top-k slot order",
    fix="moe_utils.unpermute (and every megatron.core module that imported it) sums each token's top-k slots in "
        "float32 in slot order from +0 and rounds once; fused and drop-and-pad paths are refused while active",
    guide="guides/megatron.md",
    cost="one float32 [tokens, hidden] accumulator and k gathers per MoE layer instead of one scatter_add "
         "(unmeasured on GPU)",
    **swap_hooks(NAME, (_HOME, "unpermute", _make, "megatron.core")),
)
