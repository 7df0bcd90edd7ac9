"""The moe-slot-order-sum patch on CPU against the stand-in vLLM: one GPU merges the top-k slots in float32 in
slot order, and two expert-parallel ranks (gloo processes standing for vLLM's EP group) give the same bits after
vLLM's cross-rank combine, while the stock merge (per-rank partial sums added across ranks) does not."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tic import patches
from tic.harness.engines.parallel import RankPool, expert_owners

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
from tic_fake_vllm import make_fake_vllm  # noqa: E402

EXPERTS, TOP_K, DIM = 8, 4, 64


def slot_outputs(seed: int = 0, n: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted per-slot expert outputs [n, k, DIM] in bfloat16 (magnitudes spread so rounding shows) and the
    experts [n, k] they came from; the last row is all -0.0 (a sign the merge must not flip)."""
    g = torch.Generator().manual_seed(seed)
    slots = (torch.randn(n, TOP_K, DIM, generator=g) * torch.logspace(-2, 2, TOP_K)[None, :, None])
    slots[-1] = -0.0
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(n)])
    return slots.to(torch.bfloat16), ids


def merged(moe_sum, slots) -> torch.Tensor:
    out = torch.empty(slots.shape[0], slots.shape[-1], dtype=slots.dtype)
    moe_sum(slots, out)
    return out


def test_one_gpu_merge_is_float32_in_slot_order(fake_vllm):
    import vllm._custom_ops as ops

    slots, _ = slot_outputs()
    stock = merged(ops.moe_sum, slots)
    want = slots.float().unbind(1)
    acc = torch.zeros(slots.shape[0], DIM)
    for s in want:
        acc = acc + s
    patches.apply(["moe-slot-order-sum"])
    got = merged(ops.moe_sum, slots)
    assert torch.equal(got, acc.to(torch.bfloat16))
    assert not torch.equal(got, stock)  # the stand-in rounds per add: the data must show the difference
    assert not torch.signbit(got[-1]).any()
    patches.apply([])
    assert torch.equal(merged(ops.moe_sum, slots), stock)


def test_unwritten_slots_of_other_ranks_are_ignored(fake_vllm):
    """A caller passing topk_ids and expert_map may leave other ranks' slots unwritten (garbage, NaN)."""
    import vllm._custom_ops as ops

    slots, ids = slot_outputs()
    expert_map = torch.tensor([0, 1, 2, 3, -1, -1, -1, -1])
    local = (expert_map[ids] >= 0)[..., None]
    clean = torch.where(local, slots, torch.zeros((), dtype=slots.dtype))
    dirty = torch.where(local, slots, torch.full((), float("nan"), dtype=slots.dtype))
    patches.apply(["moe-slot-order-sum"])
    out = torch.empty(slots.shape[0], DIM, dtype=slots.dtype)
    ops.moe_sum(dirty, out, ids, expert_map)
    assert torch.equal(out, merged(ops.moe_sum, clean))


# -- two EP ranks ------------------------------------------------------------------------------------------
class _GroupStandIn:
    """The part of vLLM's GroupCoordinator the patch uses, over the gloo world group."""

    def __init__(self):
        self.world_size, self.rank_in_group = dist.get_world_size(), dist.get_rank()

    def all_reduce(self, t):
        t = t.clone()
        dist.all_reduce(t)
        return t


def _ep_rank(state, fake_root: str, patched: bool):
    """One EP rank: its experts' slots (zeros elsewhere, as vLLM's GEMM writes them), moe_sum, then vLLM's
    combine (a cross-rank sum of every rank's moe_sum output)."""
    sys.path.insert(0, fake_root)
    import vllm._custom_ops as ops
    from vllm.distributed import parallel_state

    parallel_state._EP = _GroupStandIn()
    patches.apply(["moe-slot-order-sum"] if patched else [])
    slots, ids = slot_outputs()
    mine = (expert_owners(EXPERTS, dist.get_world_size())[ids] == dist.get_rank())[..., None]
    out = merged(ops.moe_sum, torch.where(mine, slots, torch.zeros((), dtype=slots.dtype)))
    dist.all_reduce(out)
    return out


@pytest.fixture(scope="module")
def ep_ranks(tmp_path_factory):
    root = make_fake_vllm(tmp_path_factory.mktemp("ep") / "site")
    with RankPool(2, timeout_s=120, threads=1) as pool:
        yield pool, str(root)


def _one_gpu(root: str, patched: bool) -> torch.Tensor:
    """EP = 1 in a fresh interpreter state: the same merge with every expert local."""
    sys.path.insert(0, root)
    try:
        for m in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
            del sys.modules[m]
        import vllm._custom_ops as ops

        patches.apply(["moe-slot-order-sum"] if patched else [])
        return merged(ops.moe_sum, slot_outputs()[0])
    finally:
        patches.apply([])
        for m in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
            del sys.modules[m]
        sys.path.remove(root)


def test_ep2_with_the_patch_is_bitwise_ep1(ep_ranks):
    pool, root = ep_ranks
    got = pool.call(_ep_rank, [(root, True)] * 2)
    want = _one_gpu(root, True)
    assert all(torch.equal(g, want) for g in got)


def test_ep2_without_the_patch_differs_from_ep1(ep_ranks):
    """The planted cross-rank fault: each rank merges its own slots, the partial sums are added across ranks."""
    pool, root = ep_ranks
    got = pool.call(_ep_rank, [(root, False)] * 2)
    assert not torch.equal(got[0], _one_gpu(root, False))
    assert not torch.equal(got[0], _one_gpu(root, True))
