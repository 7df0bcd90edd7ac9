"""Parallel layouts with two gloo processes: the expert-merge rule keeps EP=2 bitwise equal to EP=1, a
cross-rank reduction of partial sums does not, DP only splits requests, and TP's all-reduce of partial
products changes low-precision results."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tic.harness.engines.parallel import ExpertParallelMoE, RankPool, combine_slot_order, row_parallel_linear

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


@pytest.mark.parametrize("combine", ["slot_order", "slot_order_allgather"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ep2_slot_order_merge_is_bitwise_ep1(ranks, dtype, combine):
    x = tokens(1, dtype=dtype)
    got = ranks.call(_moe_rank, [(s, combine, dtype) for s in shares(x)])
    assert torch.equal(torch.cat(got), reference(x, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_planted_cross_rank_partial_sums_break_ep2(ranks, dtype):
    x = tokens(1, dtype=dtype)
    # at EP = 1 the partial-sum merge is the rule itself: only the cross-rank reduction changes bits
    assert torch.equal(reference(x, "rank_partials", dtype), reference(x, dtype=dtype))
    got = torch.cat(ranks.call(_moe_rank, [(s, "rank_partials", dtype) for s in shares(x)]))
    assert not torch.equal(got, reference(x, dtype=dtype))


@pytest.mark.parametrize("combine", ["slot_order", "slot_order_allgather"])
def test_rank_without_tokens_still_serves_its_experts(ranks, combine):
    x = tokens(2, n=9)
    got = ranks.call(_moe_rank, [(x, combine, torch.float32), (x[:0], combine, torch.float32)])
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


# ---- gates across layouts: the hf engine on gloo rank processes ---------------------------------------------
@pytest.fixture
def moe_top4(example):
    """The tiny Qwen3-MoE with 4 experts per token: with 2, a sum of two terms has one order only, so no
    merge could show a reduction-order fault. The layout configs run it in bf16 (as rollouts do), where a
    changed order reaches the sampled tokens' logprobs; in fp32 it mostly rounds away in this small model."""
    import json

    ex = example("tiny-qwen3-moe")
    cfg = json.loads((ex / "config.json").read_text())
    cfg["num_experts_per_tok"] = 4
    (ex / "config.json").write_text(json.dumps(cfg))
    return ex


def layouts_yaml(ex, rollout_parallel: str, combine: str = "slot_order", locate: bool = False):
    path = ex / "layouts.yaml"
    path.write_text(f"""model: {{path: ., dtype: bfloat16, generate: {{seed: 0}}}}
rollout: {{engine: hf, kernels: consistent, batch_size: 4, parallel: {rollout_parallel},
          options: {{expert_combine: {combine}}}}}
train: {{engine: hf, kernels: consistent, micro_batch_size: 4}}
prompts: {{source: random, count: 2, seed: 0, min_len: 3, max_len: 6}}
sampling: {{temperature: 1.0, max_tokens: 3, seed: 0}}
locate: {{enabled: {str(locate).lower()}}}
""")
    return path


def run_c5(path):
    from tic.gates import get
    from tic.config.schema import load_config
    from tic.skill.context import GateContext
    from tic.skill.runner import run_gate

    ctx = GateContext(load_config(path))
    try:
        return run_gate(get("C5"), ctx), ctx
    finally:
        for eng in ctx._engines.values():
            getattr(eng, "close", lambda: None)()


def test_c5_passes_rollout_dp2_ep2_against_one_rank_training(moe_top4, workdir):
    res, ctx = run_c5(layouts_yaml(moe_top4, "{dp: 2, ep: 2}"))
    assert res.verdict == "pass", res.reason
    assert res.metrics["tokens"] == 6
    assert {s.meta["rank"] for s in ctx.rollout_samples()} == {0, 1}
    assert res.environment["parallel"]["rollout"]["ep"] == 2 and res.environment["parallel"]["train"]["ep"] == 1


def test_c5_fails_on_planted_cross_rank_expert_reduction(moe_top4, workdir):
    res, _ = run_c5(layouts_yaml(moe_top4, "{dp: 2, ep: 2}", combine="rank_partials", locate=True))
    assert res.verdict == "fail" and "train differs from rollout" in res.reason
    # the locator reruns the compared request on its owning rank, the other rank serving its experts
    loc = res.details["locate"]
    assert loc["first_divergent_layer"] == "model.layers.1" and loc["culprit_module"] == "model.layers.1.mlp"
    assert loc["reproduced_gate_values"] and "c10d.allgather_" in loc["status"]  # side A's collectives named


def test_c0_states_layouts_and_passes_covered_ones(moe_top4, workdir, tic):
    import json

    code, out, _ = tic("gate", "C0", "-c", str(layouts_yaml(moe_top4, "{dp: 2, ep: 2}")), "--json")
    rec = json.loads(out)["results"][0]
    assert code == 0 and rec["verdict"] == "pass"
    assert rec["details"]["layouts"] == {"rollout": "DP2 EP2", "train": "1 rank"}
    assert "top-k slot order" in rec["details"]["layouts_covered"]


@pytest.mark.parametrize("parallel, why", [
    ("{dp: 2, ep: 3}", "ep=3 must divide"),
    ("{dp: 2, ep: 2, xp: 1}", "unknown key"),
])
def test_bad_layout_is_an_input_error(moe_top4, workdir, tic, parallel, why):
    code, _, err = tic("gate", "C0", "-c", str(layouts_yaml(moe_top4, parallel)))
    assert code == 2 and why in err


def test_unknown_hf_option_is_an_input_error(moe_top4, workdir, tic):
    code, _, err = tic("gate", "C5", "-c", str(layouts_yaml(moe_top4, "{dp: 2, ep: 2}", combine="fastest")))
    assert code == 2 and "expert_combine" in err


@pytest.mark.parametrize("patches, verdict", [("[]", "fail"), ("[moe-slot-order-sum]", "pass")])
def test_c0_refuses_vllm_expert_parallel_without_the_slot_order_merge(moe_top4, workdir, tic, patches, verdict):
    import json

    cfg = moe_top4 / "vllm-ep.yaml"
    cfg.write_text("model: {path: ., generate: {seed: 0}}\n"
                   f"rollout: {{engine: vllm, parallel: {{tp: 1, dp: 2, ep: 2}}, patches: {patches}}}\n")
    code, out, _ = tic("gate", "C0", "-c", str(cfg), "--json")
    rec = json.loads(out)["results"][0]
    assert rec["verdict"] == verdict and code == (1 if verdict == "fail" else 0)
    assert ("moe-slot-order-sum patch" in rec["reason"]) == (verdict == "fail")


def test_ep1_merge_is_the_cpu_providers_moe_experts():
    """A block driven by tic's kernel modules: EP = 1 here is bit for bit the provider's own moe_experts."""
    from tic.harness.kernels.consistent_cpu import CPUProvider

    prov = CPUProvider()
    block = moe_block(0)
    block._tic_ops = SimpleNamespace(provider=prov)
    x = tokens(5, n=10)
    w, ids = prov.moe_route(prov.linear(x, block.gate.weight), 4, True)
    want = prov.moe_experts(x, w, ids, block.experts.gate_up_proj, block.experts.down_proj)
    assert torch.equal(ExpertParallelMoE(block, None, 1)(x), want)


def test_gpu_training_ranks_run_data_parallel_only(example):
    """hf expert parallel exchanges tokens over gloo on CPU; on GPUs the hf ranks are DP replicas only."""
    from tic.core.errors import TicInputError
    from tic.harness.engines.hf_ranks import RankedHFEngine

    with pytest.raises(TicInputError, match="GPU ranks run data parallel only"):
        RankedHFEngine(example("tiny-qwen3-moe"), dp=2, ep=2, device="cuda")


def test_c0_refuses_vllm_expert_parallel_over_other_exchanges(moe_top4, workdir, tic, monkeypatch):
    import json

    cfg = moe_top4 / "vllm-ep.yaml"
    cfg.write_text("model: {path: ., generate: {seed: 0}}\n"
                   "rollout: {engine: vllm, parallel: {dp: 2, ep: 2}, patches: [moe-slot-order-sum]}\n")
    monkeypatch.setenv("VLLM_ALL2ALL_BACKEND", "deepep_high_throughput")
    code, out, _ = tic("gate", "C0", "-c", str(cfg), "--json")
    rec = json.loads(out)["results"][0]
    assert code == 1 and "VLLM_ALL2ALL_BACKEND=deepep_high_throughput" in rec["reason"]
    monkeypatch.setenv("VLLM_ALL2ALL_BACKEND", "allgather_reducescatter")
    code, out, _ = tic("gate", "C0", "-c", str(cfg), "--json")
    assert code == 0


def test_expert_parallel_ranks_refuse_a_router_that_is_not_a_softmax_top_k():
    """The EP ranks route by a softmax top-k (their own route() or the provider's): a block whose router the
    wrappers read as a score router (GLM-4.5's) is refused in one line, not routed by the wrong rule. Control: a
    softmax router's block builds."""
    from tic.core.errors import TicInputError
    from tic.harness.kernels.routing import Routing

    gate = SimpleNamespace(weight=torch.zeros(4, 8), top_k=2)
    scored = SimpleNamespace(gate=gate, experts=None, _tic_routing=Routing("sigmoid", biased=True, scale=2.5))
    with pytest.raises(TicInputError, match="softmax top-k routers only, not sigmoid, renormalised, selection bias"):
        ExpertParallelMoE(scored, None, 1)
    ExpertParallelMoE(SimpleNamespace(gate=gate, experts=None, _tic_routing=Routing()), None, 1)
