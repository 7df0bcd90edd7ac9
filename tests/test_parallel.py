"""Parallel layouts with two gloo processes: the expert-merge rule keeps EP=2 bitwise equal to EP=1, a
cross-rank reduction of partial sums does not, DP only splits requests, and TP's all-reduce of partial
products changes low-precision results."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tic.harness.parallel import ExpertParallelMoE, RankPool, combine_slot_order, row_parallel_linear

TIMEOUT = 120


def moe_block(seed: int, experts: int = 8, top_k: int = 4, dim: int = 32, inter: int = 16,
              dtype=torch.float32):
    """A sparse-MoE block shaped like transformers' (router `gate`, stacked `experts`), seeded weights."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: (torch.randn(*s, generator=g) * 0.3).to(dtype)  # noqa: E731
    gate = SimpleNamespace(weight=rnd(experts, dim), top_k=top_k, norm_topk_prob=True)
    ex = SimpleNamespace(gate_up_proj=rnd(experts, 2 * inter, dim), down_proj=rnd(experts, dim, inter),
                         act_fn=F.silu)
    return SimpleNamespace(gate=gate, experts=ex)


def tokens(seed: int, n: int = 24, dim: int = 32, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed)).to(dtype)


def reference(x, combine="slot_order", dtype=torch.float32) -> torch.Tensor:
    """EP = 1: one process holds every expert and every token."""
    return ExpertParallelMoE(moe_block(0, dtype=dtype), None, 1, combine)(x)


# Functions run inside the rank processes (module level, so spawn can import them).
def _moe_rank(state, x_share, combine, dtype):
    block = moe_block(0, dtype=dtype)
    return ExpertParallelMoE(block, dist.group.WORLD, dist.get_world_size(), combine)(x_share)


def _tp_rank(state, x, w):
    return row_parallel_linear(x, w)


@pytest.fixture(scope="module")
def ranks():
    with RankPool(2, timeout_s=TIMEOUT, threads=1) as pool:
        yield pool


def shares(x, dp: int = 2) -> list[torch.Tensor]:
    """DP: each rank holds a contiguous block of the tokens (uneven on purpose: 11 and 13 rows)."""
    cut = x.shape[0] // dp - 1
    return [x[:cut], x[cut:]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ep2_slot_order_merge_is_bitwise_ep1(ranks, dtype):
    x = tokens(1, dtype=dtype)
    got = ranks.call(_moe_rank, [(s, "slot_order", dtype) for s in shares(x)])
    assert torch.equal(torch.cat(got), reference(x, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_planted_cross_rank_partial_sums_break_ep2(ranks, dtype):
    x = tokens(1, dtype=dtype)
    # at EP = 1 the partial-sum merge is the rule itself: only the cross-rank reduction changes bits
    assert torch.equal(reference(x, "rank_partials", dtype), reference(x, dtype=dtype))
    got = torch.cat(ranks.call(_moe_rank, [(s, "rank_partials", dtype) for s in shares(x)]))
    assert not torch.equal(got, reference(x, dtype=dtype))


def test_rank_without_tokens_still_serves_its_experts(ranks):
    x = tokens(2, n=9)
    got = ranks.call(_moe_rank, [(x, "slot_order", torch.float32), (x[:0], "slot_order", torch.float32)])
    assert got[1].shape == (0, 32) and torch.equal(got[0], reference(x))


def test_dp2_only_splits_requests():
    """DP = 2 with EP = 1: each rank computes its own rows alone; concatenated they are the DP = 1 rows."""
    x = tokens(3)
    assert torch.equal(torch.cat([reference(s) for s in shares(x)]), reference(x))


def test_tp2_all_reduce_of_partials_differs_in_bf16(ranks):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(16, 256, generator=g).to(torch.bfloat16)
    w = torch.randn(64, 256, generator=g).to(torch.bfloat16)
    got = ranks.call(_tp_rank, [(x, w), (x, w)])
    assert torch.equal(got[0], got[1])  # both ranks hold the same all-reduced result
    assert not torch.equal(got[0], F.linear(x, w))


def test_slot_order_is_the_order_of_slots():
    outs = torch.tensor([[[1e8], [1.0], [-1e8]]], dtype=torch.float32)
    w = torch.ones(1, 3)
    assert combine_slot_order(outs, w).item() == 0.0  # (1e8 + 1) - 1e8 in fp32
    assert combine_slot_order(outs[:, [0, 2, 1]], w).item() == 1.0
