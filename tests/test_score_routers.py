"""Routers in the DeepSeek-V3 way (GLM-4.5, EXAONE-MoE, dots1, Solar-Open, ...): sigmoid scores, a selection bias
that only chooses, experts in groups of which each token keeps the best, weights renormalised and scaled by
routed_scaling_factor. Read from the router's own forward (coverage.router_routing), computed by the consistent
kernels and checked against the stock model (C2), across layouts and decode (C3-C6) and in the backward (C7).

A generated checkpoint holds the selection bias at zero (transformers' init), where routing with or without it is
the same: the model here draws it, so that a wrapper that drops it parts from the stock model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import CONFIG_MAPPING

from tic.gates import get
from tic.harness.engines import hf
from tic.harness.kernels import coverage, routing
from tic.harness.kernels.routing import Routing
from tic.harness.model.layer_structure import build_meta
from tic.skill.context import GateContext
from tic.skill.runner import run_gate

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
from tic_small_ladder import assert_climbs, small_ladder_ctx  # noqa: E402

GLM = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
           n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
           first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
           pad_token_id=0, bos_token_id=1, eos_token_id=2)
GROUPED = Routing("sigmoid", renormalize=True, biased=True, groups=2, topk_groups=1, scale=2.5)


def glm_config(**changes):
    if "glm4_moe" not in CONFIG_MAPPING:
        pytest.skip("no glm4_moe in this transformers")
    return CONFIG_MAPPING["glm4_moe"](**{**GLM, **changes})


def glm_router(**changes):
    model = build_meta(glm_config(**changes).to_dict())
    block = next(m for m in model.modules() if coverage.is_moe_block(m))
    return model, block, coverage.moe_router(block)


@pytest.mark.parametrize("changes, want", [
    ({}, GROUPED),
    ({"n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0},
     Routing("sigmoid", renormalize=True, biased=True)),
    ({"norm_topk_prob": False}, Routing("sigmoid", renormalize=False, biased=True, groups=2, topk_groups=1,
                                        scale=2.5)),
])
def test_a_score_router_is_read_from_its_own_forward(changes, want):
    model, block, router = glm_router(**changes)
    assert coverage.router_routing(router, model.config) == want
    assert coverage_problems_of(model, "consistent") == []


def coverage_problems_of(model, kernels):
    return coverage.coverage_problems(model, kernels)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_bf16_router_over_many_experts_is_read_on_the_cpu_in_float32(dtype):
    """A real-size softmax router (128 experts, top 8, the Qwen3-30B-A3B shape) in the model's bf16: read in bf16, its
    logits at the probe's small scales tie exactly between experts, its top-k broke the ties otherwise than the
    rules' selection, no rule fit, and C0 refused the model on the GPU. The probe runs a float32 CPU copy."""
    if "qwen3_moe" not in CONFIG_MAPPING:
        pytest.skip("no qwen3_moe in this transformers")
    cfg = CONFIG_MAPPING["qwen3_moe"](hidden_size=2048, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    router = Qwen3MoeTopKRouter(cfg).to(dtype)
    assert coverage.router_routing(router, cfg) == Routing("softmax", renormalize=True)
    assert router.weight.dtype == dtype  # the model's own router is left as it was


class _SigmoidRouter(torch.nn.Module):
    """Sigmoid scores without a bias, the top-k renormalised (Flint's router), over 32 experts of 256 features."""

    def __init__(self):
        super().__init__()
        self.top_k, self.weight = 4, torch.nn.Parameter(torch.zeros(32, 256))

    def forward(self, x):
        logits = torch.nn.functional.linear(x.float(), self.weight.float())
        w, ids = torch.topk(logits.sigmoid(), self.top_k, dim=-1)
        return logits, w / w.sum(-1, keepdim=True), ids


def test_a_router_whose_scores_saturate_on_the_probe_is_still_read():
    """On the probe's widest rows, seeded weights give logits of about 16: sigmoid rounds many of them to 1.0, the
    router's top-k breaks those ties its own way, and every rule failed there, so none was read (Flint refused).
    A scale where a rule's choice ties at the k-th expert no longer judges that rule."""
    assert coverage._tied_at(torch.tensor([[1.0, 1.0, 0.5]]), 1) and not coverage._tied_at(torch.tensor([[1.0, 0.9,
                                                                                                         0.9]]), 1)
    assert coverage.router_routing(_SigmoidRouter()) == Routing("sigmoid", renormalize=True)


def test_the_vllm_kernels_refuse_a_score_router_in_one_line_naming_it():
    """vLLM's side of these routers (its grouped top-k kernel, where it applies the scale) is not yet measured on
    the GPU: kernels: vllm refuses them at C0 instead of running a rule it may not share."""
    model, _, _ = glm_router()
    problems = coverage_problems_of(model, "vllm")
    assert len(problems) == 1 and "moe:score_router is not implemented by kernels: vllm" in problems[0], problems
    assert "sigmoid, renormalised, selection bias, 1 of 2 groups, x 2.5" in problems[0], problems


def test_a_router_scaled_twice_is_refused_not_guessed(monkeypatch):
    """Planted: the router's weights times 2 on top of its routed_scaling_factor, a rule no candidate holds: the
    reading answers None and C0 names the block. Control: the same router unplanted reads (test above)."""
    model, block, router = glm_router()
    cls = type(router)
    forward = cls.forward
    monkeypatch.setattr(cls, "forward", lambda self, x: (lambda o: (o[0], o[1] * 2, o[2]))(forward(self, x)))
    assert coverage.router_routing(router, model.config) is None
    problems = coverage_problems_of(model, "consistent")
    assert any("Glm4MoeMoE" in p and "a router whose top-k experts and weights are none of the rules" in p
               for p in problems), problems


def test_a_routed_scaling_factor_the_routers_weights_do_not_carry_is_refused(monkeypatch):
    """A block that scales the routed output itself, its router giving unscaled weights (planted: GLM's router
    with its scale divided out again): the config's routed_scaling_factor is then applied where the wrappers do not
    apply it, so C0 names it instead of assuming either place."""
    model, block, router = glm_router()
    cls = type(router)
    forward = cls.forward
    monkeypatch.setattr(cls, "forward", lambda self, x: (lambda o: (o[0], o[1] / 2.5, o[2]))(forward(self, x)))
    assert coverage.router_routing(router, model.config).scale == 1.0
    problems = coverage_problems_of(model, "consistent")
    assert any("routed_scaling_factor outside the router's top-k weights" in p and "2.5" in p for p in problems), \
        problems


def test_a_router_without_a_top_k_count_is_not_read_and_c0_does_not_crash():
    """DeepSeek-V2's config leaves num_experts_per_tok unset by default, so its router's top_k is None: the reading
    answers None (C0 refuses the block in a line) instead of raising (an exit 3 in the C0 sweep over every type)."""
    if "deepseek_v2" not in CONFIG_MAPPING:
        pytest.skip("no deepseek_v2 in this transformers")
    model = build_meta(CONFIG_MAPPING["deepseek_v2"](vocab_size=512, hidden_size=64, num_hidden_layers=2,
                                                     num_attention_heads=4, num_key_value_heads=2).to_dict())
    block = next(m for m in model.modules() if coverage.is_moe_block(m))
    assert coverage.moe_router(block).top_k is None
    assert coverage.router_routing(coverage.moe_router(block), model.config) is None
    assert any("a router whose top-k experts and weights are none of the rules" in p
               for p in coverage_problems_of(model, "consistent"))


def test_grouped_selection_keeps_the_best_groups_and_breaks_ties_to_the_lower_id():
    s = torch.tensor([[0.9, 0.1, 0.8, 0.7, 0.2, 0.2, 0.6, 0.6]])
    bias = torch.zeros(8)
    # groups (by the sum of their two best): 1.0, 1.5, 0.4, 1.2 -> keep groups 1 and 3
    ids = routing.select(s + bias, 2, Routing("sigmoid", biased=True, groups=4, topk_groups=2))
    assert ids.tolist() == [[2, 3]]
    # without a bias a group scores its best expert: 0.9, 0.8, 0.2, 0.6 -> groups 0 and 1
    assert routing.select(s, 2, Routing("sigmoid", groups=4, topk_groups=2)).tolist() == [[0, 2]]
    # the two 0.6s of group 3 tie: the lower id goes first
    assert routing.select(s, 2, Routing("sigmoid", groups=4, topk_groups=1)).tolist() == [[0, 1]]
    assert routing.select(s[:, 6:], 2, Routing("sigmoid")).tolist() == [[0, 1]]
    # chosen on the logits plus the bias (Kolibri), the weights still the scores at those ids
    logits, bias = torch.tensor([[2.0, 0.0, -1.0]]), torch.tensor([-3.0, 0.5, 2.5])
    rule = Routing("sigmoid", biased=True, on_logits=True)
    c = routing.choice(routing.scores(logits, rule), logits, bias, rule)
    assert torch.equal(c, logits + bias) and routing.select(c, 1, rule).tolist() == [[2]]


def _grouped_glm_gate(rows: torch.Tensor):
    """A bf16 GLM-4.5 MoE block of 16 experts in 4 groups (2 kept, top 4), its router an identity on the first 16
    hidden features and its selection bias zero: rows of logits are its logits, exactly."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = glm_config(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4, first_k_dense_replace=0,
                     num_hidden_layers=1)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    name, block = next((n, m) for n, m in model.named_modules() if coverage.is_moe_block(m))
    gate = coverage.moe_router(block)
    with torch.no_grad():
        gate.weight.zero_()
        gate.weight[:, :16] = torch.eye(16)
        block.gate.e_score_correction_bias.zero_()
    x = torch.zeros(rows.shape[0], cfg.hidden_size, dtype=torch.bfloat16)
    x[:, :16] = rows.to(torch.bfloat16)
    return model, name, gate, x


def test_the_fidelity_pin_takes_a_choice_that_parts_at_a_near_tie_of_two_groups_only():
    """A grouped router decides twice: two groups' scores (the sums of their two best) within a rounding step of
    each other swap experts whose own scores are 8 % apart. The stock router's own choice keeps group 0; the
    wrapped model's, group 2 by that near tie: a near tie, taken. Experts of group 3, which no rounding step
    reaches, are not: the router keeps its own."""
    from tic.harness.measure.gradcheck import RoutingPin

    scores = torch.tensor([0.60, 0.60, 0.05, 0.05, 0.70, 0.70, 0.05, 0.05,   # groups 0 (1.20) and 1 (1.40)
                           0.65, 0.547, 0.05, 0.05, 0.30, 0.29, 0.05, 0.05])  # group 2 (1.197), group 3 (0.59)
    model, name, gate, x = _grouped_glm_gate(torch.logit(scores)[None])
    with torch.no_grad():
        own = gate(x)[2].sort(-1).values
    assert own.tolist() == [[0, 1, 4, 5]]
    by_the_tie, outright = torch.tensor([[4, 5, 8, 9]]), torch.tensor([[4, 5, 12, 13]])
    for given, want in ((by_the_tie, by_the_tie), (outright, own)):
        pin = RoutingPin(model, near_tie=torch.finfo(torch.bfloat16).eps)
        with pin.pinned({name: given}), torch.no_grad():
            assert gate(x)[2].sort(-1).values.tolist() == want.tolist()
        assert pin.flips == int(want is by_the_tie)


def test_the_route_backward_is_the_float64_reference_gradient():
    """The written-out backward of weights(scores(logits), ids) against autograd through it in float64, for the
    sigmoid and softmax scores, renormalised or not, scaled."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 8, generator=g, dtype=torch.float64)
    grad = torch.randn(5, 2, generator=g, dtype=torch.float64)
    for rule in (GROUPED, Routing("sigmoid", renormalize=False, scale=2.5), Routing(), Routing(renormalize=False)):
        s = routing.scores(logits, rule)
        ids = routing.select(routing.choice(s, logits, torch.randn(8, generator=g), rule), 2, rule)
        x = logits.clone().requires_grad_(True)
        want, = torch.autograd.grad(routing.weights(routing.scores(x, rule), ids, rule), x, grad)
        got = routing.weights_backward(logits, ids, grad, rule)
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-14), rule


def score_router_ctx(tmp_path, monkeypatch, config, dtype: str) -> GateContext:
    """A small model of `config` whose selection biases and routers are drawn (small_ladder_ctx)."""
    return small_ladder_ctx(tmp_path, monkeypatch, config, dtype)


@pytest.fixture
def glm_ctx(tmp_path, monkeypatch):
    yield score_router_ctx(tmp_path, monkeypatch, glm_config(), "float32")
    hf._MODELS.clear()


# other families of the same kind, each with what its config names differently (expert counts, top-k)
FAMILIES = {
    "glm4_moe": {},
    "dots1": {},  # sigmoid, not renormalised by default
    "exaone_moe": {"num_experts": 8},
    "ernie4_5_moe": {"moe_num_experts": 8, "moe_k": 2, "moe_layer_start_index": 1, "routed_scaling_factor": 1.0},
    # the block holds the bias and hands it to its router's forward (HunYuan-V3 also sums shared + routed in
    # float32: one add, the bits of the model dtype's add)
    "minimax_m2": {"num_local_experts": 8, "routed_scaling_factor": 1.0},
    "hy_v3": {"num_local_experts": 8, "num_experts": 8, "routed_scaling_factor": 1.0},
    "kolibri1": {"num_experts": 8, "norm_topk_prob": True, "routed_scaling_factor": 1.0},  # chosen on logits + bias
    # the router's weight in a linear child `gate`, its forward taking [B, T, H] rows only, the block's bias a
    # parameter it hands the router, the scale named route_scale; sliding and global layers, an output-gated attention
    "afmoe": {"num_experts": 8, "num_dense_layers": 1, "num_shared_experts": 1, "route_scale": 2.0,
              "routed_scaling_factor": 1.0, "global_attn_every_n_layers": 2, "sliding_window": 8},
}


@pytest.mark.parametrize("model_type, dtype", [("glm4_moe", "float32"), ("glm4_moe", "bfloat16"),
                                               ("dots1", "float32"), ("exaone_moe", "float32"),
                                               ("ernie4_5_moe", "float32"), ("minimax_m2", "float32"),
                                               ("hy_v3", "float32"), ("hy_v3", "bfloat16"),
                                               ("kolibri1", "float32"), ("afmoe", "float32")])
def test_a_score_router_climbs_c0_to_c7(tmp_path, monkeypatch, one_thread, model_type, dtype):
    """In bfloat16 the router stays in float32 (transformers keeps it so, as vLLM's GLM does): the wrappers give
    it float32 rows. Ernie-4.5's is a softmax router with a selection bias."""
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"no {model_type} in this transformers")
    config = CONFIG_MAPPING[model_type](**{**GLM, **FAMILIES[model_type]})
    ctx = score_router_ctx(tmp_path, monkeypatch, config, dtype)
    try:
        for gate in ("C0", "C2", "C3", "C4", "C5", "C6", "C7"):
            res = run_gate(get(gate), ctx)
            assert res.verdict == "pass", (gate, res.reason)
        blocks = [m for m in ctx.rollout_engine().model.modules() if coverage.is_moe_block(m)]
        assert blocks and all(not b._tic_routing.plain and b._tic_routing.biased for b in blocks)
        router = coverage.moe_router(blocks[0])
        assert coverage.block_routing_bias(blocks[0]).abs().sum() > 0  # drawn: the bias chooses
        if model_type == "glm4_moe":
            assert blocks[0]._tic_routing == GROUPED and router.weight.dtype == torch.float32
    finally:
        hf._MODELS.clear()


@pytest.mark.parametrize("plant", ["no bias", "no groups", "no scale"])
def test_a_wrapper_that_drops_a_part_of_the_rule_parts_from_the_stock_model(glm_ctx, one_thread, plant):
    """Planted: the wrappers route without the selection bias, without the groups, or without the scale. C2's
    fidelity check names the MoE block (its routing pin does not hide it: these are not near ties)."""
    changed = {"no bias": {"biased": False}, "no groups": {"groups": 1, "topk_groups": 1},
               "no scale": {"scale": 1.0}}[plant]
    for engine in (glm_ctx.rollout_engine(), glm_ctx.train_engine()):
        for m in engine.model.modules():
            if coverage.is_moe_block(m):
                m._tic_routing = Routing(**{**GROUPED.__dict__, **changed})
    res = run_gate(get("C2"), glm_ctx)
    assert res.verdict == "fail" and res.details["fidelity"]["first_parting_module"].endswith(".mlp"), res.reason



def test_a_wrapper_that_chooses_on_the_scores_parts_where_the_router_chooses_on_the_logits(tmp_path, monkeypatch,
                                                                                           one_thread):
    """Planted: Kolibri's router chooses on logits + bias; the wrappers choosing on sigmoid(logits) + bias pick
    other experts, and C2 names the MoE block. Control: Kolibri's climb above."""
    import dataclasses

    if "kolibri1" not in CONFIG_MAPPING:
        pytest.skip("no kolibri1 in this transformers")
    ctx = score_router_ctx(tmp_path, monkeypatch, CONFIG_MAPPING["kolibri1"](**{**GLM, **FAMILIES["kolibri1"]}),
                           "float32")
    try:
        blocks = {id(m): m for engine in (ctx.rollout_engine(), ctx.train_engine())  # one model, if shared
                  for m in engine.model.modules() if coverage.is_moe_block(m)}
        assert blocks and all(b._tic_routing.on_logits for b in blocks.values())
        for b in blocks.values():
            b._tic_routing = dataclasses.replace(b._tic_routing, on_logits=False)
        res = run_gate(get("C2"), ctx)
        assert res.verdict == "fail" and res.details["fidelity"]["first_parting_module"].endswith(".mlp"), res.reason
    finally:
        hf._MODELS.clear()


def test_an_moe_block_with_a_submodule_its_wrapper_does_not_run_is_refused():
    """A.X-K1's MoE block norms its own output (`post_mlp_layernorm`), which the MoE wrapper never runs: C0 names
    the block and the child instead of letting C2 find the wrapped model parting there. Planted on GLM-4.5's block
    (control: the same block without it reads clean, test above); A.X-K1 itself where transformers has it."""
    model, block, _ = glm_router()
    block.post_mlp_layernorm = torch.nn.LayerNorm(64, device="meta")
    problems = coverage_problems_of(model, "consistent")
    assert any("Glm4MoeMoE" in p and "an MoE block with submodules its wrapper does not run (post_mlp_layernorm)"
               in p for p in problems), problems
    if "axk1" in CONFIG_MAPPING:
        axk1 = build_meta(CONFIG_MAPPING["axk1"](**{**GLM, "num_key_value_heads": GLM["num_attention_heads"],
                                                     "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
                                                     "qk_rope_head_dim": 4, "v_head_dim": 8}).to_dict())
        problems = coverage_problems_of(axk1, "consistent")
        assert len(problems) == 1 and "(AXK1MoE): an MoE block with submodules" in problems[0], problems


def test_afmoes_router_is_read_through_its_gate_linear_on_three_dimensional_rows():
    """AFMoE: the weight in the router's `gate` linear, rows handed as [1, T, H] (its forward unpacks three
    dimensions), the block's expert_bias (a parameter) handed to the router and used only to choose, the weights
    renormalised and scaled by route_scale."""
    if "afmoe" not in CONFIG_MAPPING:
        pytest.skip("no afmoe in this transformers")
    model = build_meta(CONFIG_MAPPING["afmoe"](**{**GLM, **FAMILIES["afmoe"]}).to_dict())
    block = next(m for m in model.modules() if coverage.is_moe_block(m))
    router = coverage.moe_router(block)
    assert coverage.router_weight(router) is router.gate.weight
    assert coverage.routing_bias_name(block) == "expert_bias"
    assert coverage.router_routing(router, model.config, coverage.handed_bias(block)) == \
        Routing("sigmoid", renormalize=True, biased=True, scale=2.0)
    assert coverage_problems_of(model, "consistent") == []


def test_flint_with_its_sigmoid_router_climbs(tmp_path, monkeypatch, one_thread):
    """Flint with MoE layers (sigmoid router, 16 experts top 4, a shared expert, attention sinks), which C0 refused
    for its router before saturated probe rows stopped judging the rules."""
    if "flint" not in CONFIG_MAPPING:
        pytest.skip("no flint in this transformers")
    cfg = CONFIG_MAPPING["flint"](vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  layer_types=["full_attention", "sliding_attention"], sliding_window=8,
                                  mlp_only_layers=[0], num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                                  shared_expert_intermediate_size=64, tie_word_embeddings=False, pad_token_id=0,
                                  bos_token_id=1, eos_token_id=2)
    model = build_meta(cfg.to_dict())
    assert any(coverage.is_moe_block(m) for m in model.modules())
    assert_climbs(small_ladder_ctx(tmp_path, monkeypatch, cfg, "float32"))


def test_a_grouped_router_keeping_as_many_groups_as_its_top_k_is_read_as_the_plain_rule_it_equals():
    """DeepSeek-V2's group_limited_greedy with topk_group >= top-k: groups scored by their best expert keep every
    top-k expert's group, so the grouped and plain rules choose alike on every input, and no probe tells them
    apart. It is read as the plain rule (before: no rule, and C0 refused the router)."""
    if "deepseek_v2" not in CONFIG_MAPPING:
        pytest.skip("no deepseek_v2 in this transformers")
    config = CONFIG_MAPPING["deepseek_v2"](
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, topk_method="group_limited_greedy", n_group=4, topk_group=2)
    model = build_meta(config.to_dict())
    router = coverage.moe_router(model.model.layers[1].mlp)
    assert coverage.router_routing(router, config) == Routing("softmax", renormalize=False)
    assert coverage_problems_of(model, "consistent") == []
    logits = torch.randn(500, 8, generator=torch.Generator().manual_seed(0))
    grouped = Routing("softmax", renormalize=False, groups=4, topk_groups=2)
    s = routing.scores(logits, grouped)
    assert torch.equal(routing.select(s, 2, grouped), routing.select(s, 2, Routing("softmax", renormalize=False)))
