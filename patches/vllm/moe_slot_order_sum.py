"""vLLM's MoE top-k merge as one float32 sum in top-k slot order, the same for every expert-parallel degree.

vLLM 0.26 ends every Triton fused-MoE call with `_moe_C.moe_sum`: the weighted per-slot expert outputs
[tokens, k, hidden] are added over the k slots in the model dtype. Under expert parallel (DP x EP with the
default allgather_reducescatter exchange, or TP + EP) each rank runs its own experts only: the slots whose
expert lives elsewhere come out of the GEMM as zeros, moe_sum adds the rank's own slots, and vLLM then adds
the ranks' partial sums across ranks (reduce-scatter or all-reduce), again in the model dtype. The merge's
association therefore follows the expert placement: with k = 4 and EP = 2, ((s0 + s2) + (s1 + s3)) where one
GPU computes (((s0 + s1) + s2) + s3), and a training recompute on another layout sees other bits (method 4.5:
expert outputs return to the token's rank and are summed there in fp32 in slot order).

The patch replaces moe_sum. Every rank's per-slot buffer is first made complete by an all-reduce over the EP
group: each element has exactly one rank whose expert wrote it (the others hold zeros), so the reduction only
moves data (x + 0 = x in any order and precision). Then the k slots are summed in float32, from zero, in slot
order, and rounded once to the model dtype. The EP group's first rank writes that sum and the other ranks write
zeros, so vLLM's following cross-rank reduction again adds zeros only. With one rank there is no exchange; tic's
training provider calls the same patched moe_sum through vLLM's fused_experts, so rollout and training merge
alike whatever their EP degree.

Covered (measured on two H200s, docs/results/parallel.md): vLLM's Triton MoE experts on one GPU and under
vLLM's default exchange, allgather_reducescatter, where every EP rank holds the same gathered tokens in the same
order. Not covered: other all-to-all backends (DeepEP and the like run moe_sum on each rank's own tokens, so the
ranks' slot buffers do not line up; C0 refuses them with EP), and MoE layers sharded as tensor parallel (TP > 1,
or vLLM's coupled DP without EP), where vLLM's EP group still exists and the all-reduce would add partial sums
(C0 refuses TP > 1; tic runs DP without EP as replicas).
"""

from __future__ import annotations

from tic.patches._swap import swap_hooks
from tic.patches.base import Patch

NAME = "moe-slot-order-sum"
_OPS = "vllm._custom_ops"


def slot_order_sum(slots, out) -> None:
    """out[t] = model-dtype rounding of sum_{s=0..k-1} float32(slots[t, s]), added in slot order from +0."""
    import torch

    acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    for s in range(slots.shape[1]):
        acc += slots[:, s].float()
    out.copy_(acc)


def _ep_group():
    """vLLM's expert-parallel group coordinator when this process is one of several EP ranks, else None."""
    try:
        from vllm.distributed import parallel_state
    except ImportError:
        return None
    group = getattr(parallel_state, "_EP", None)
    return group if group is not None and group.world_size > 1 else None


def moe_sum_slot_order(input, output, topk_ids=None, expert_map=None) -> None:
    """Drop-in for `vllm._custom_ops.moe_sum(input [M, k, H], output [M, H], topk_ids, expert_map)`."""
    import torch

    slots = input.view(output.shape[0], -1, output.shape[-1])
    if topk_ids is not None and expert_map is not None:  # callers that leave other ranks' slots unwritten
        local = (expert_map[topk_ids.long()] >= 0)[..., None]
        slots = torch.where(local, slots, torch.zeros((), dtype=slots.dtype, device=slots.device))
    group = _ep_group()
    if group is None:
        slot_order_sum(slots, output)
        return
    slots = group.all_reduce(slots.contiguous())  # one writer per element: data movement only
    if group.rank_in_group == 0:
        slot_order_sum(slots, output)
    else:
        output.zero_()  # vLLM's combine adds the ranks' outputs: this rank contributes exact zeros


PATCH = Patch(
    name=NAME, target="vllm", versions=">=0.26.0,<0.27", gate="C5",
    symptom="C5 fails in a MoE layer (mlp / experts, operator _moe_C.moe_sum or the expert combine) when rollout "
            "and training hold experts on different numbers of ranks (EP = 2 rollout vs a one-GPU recompute): "
            "the top-k merge is rounded in the model dtype in an order that follows the expert placement",
    fix="moe_sum completes each rank's per-slot outputs with an exact all-reduce over the EP group (one writer "
        "per element), sums the k slots in float32 in slot order from zero, rounds once, and lets only the EP "
        "group's first rank write the result so vLLM's cross-rank combine adds zeros; EP = 1 and tic's training "
        "provider run the same sum",
    guide="guides/C5.md",
    cost="EP > 1: one all-reduce of the [tokens, k, hidden] slot buffer per MoE layer (k times the combine's "
         "bytes) plus a float32 sum; EP = 1: the float32 sum only (k small elementwise passes)",
    **swap_hooks(NAME, (_OPS, "moe_sum", lambda original: moe_sum_slot_order, "vllm.")),
)
