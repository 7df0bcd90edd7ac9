"""Architectures no example names: C0's coverage reading of transformers' own model types, built small on the meta
device. Each either reads as covered or is refused in lines that name a module; none may crash the reading. The
covered ones below also climb C0-C7 in tests/test_coverage.py's families where an example holds them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import CONFIG_MAPPING

from tic.core.errors import TicInputError
from tic.harness.kernels.coverage import coverage_problems, final_norm
from tic.harness.model.layer_structure import build_meta

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
from tic_small_ladder import SMALL_LADDER  # noqa: E402

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_routed_experts=4, num_local_experts=4,
             n_shared_experts=1, first_k_dense_replace=1, moe_k=2, moe_num_experts=4, moe_topk=2)

# read as covered on both providers
COVERED = ("ernie4_5", "seed_oss", "cwm", "ministral", "mixtral", "arcee", "nemotron", "hunyuan_v1_dense",
           "hunyuan_v1_moe", "granitemoe", "nanochat", "olmo", "persimmon")
# refused, each for something the wrappers do not compute (named in the problem lines)
REFUSED = {"phimoe": "router", "diffllama": "lambda_q1",
           "doge": "input_residual", "bitnet": "attn_sub_norm",
           "jetmoe": "layer structure", "llama4_text": "qk_norm",
           "qwen3_next": "a gate or heads the wrappers do not split"}


def small(model_type: str):
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {model_type!r} not in this release")
    return build_meta(CONFIG_MAPPING[model_type](**SMALL).to_dict())


@pytest.mark.parametrize("model_type", COVERED)
def test_a_covered_architecture_reads_without_problems(model_type):
    model = small(model_type)
    for kernels in ("consistent", "vllm"):
        assert coverage_problems(model, kernels) == [], (model_type, kernels)


# routers in the DeepSeek-V3 way (tests/test_score_routers.py): covered by the consistent kernels; vLLM's side of
# them is not measured yet, so kernels: vllm names them
SCORE_ROUTERS = ("glm4_moe", "ernie4_5_moe", "dots1", "solar_open", "exaone_moe", "sarvam_moe", "param2moe",
                 "minimax_m2", "hy_v3", "kolibri1")


@pytest.mark.parametrize("model_type", SCORE_ROUTERS)
def test_a_score_router_architecture_reads_as_covered_by_the_consistent_kernels(model_type):
    model = small(model_type)
    assert coverage_problems(model, "consistent") == [], model_type
    problems = coverage_problems(model, "vllm")
    assert problems and all("moe:score_router is not implemented by kernels: vllm" in p for p in problems), problems


# an activation module of the model's own (Apertus' xIELU, tests/test_own_activation.py): the consistent kernels run
# it row by row; vLLM's xIELU is not wired to the wrappers, so kernels: vllm names it
@pytest.mark.parametrize("model_type", ("apertus", "apertus1p5_text"))
def test_an_own_activation_architecture_reads_as_covered_by_the_consistent_kernels(model_type):
    model = small(model_type)
    assert coverage_problems(model, "consistent") == [], model_type
    problems = coverage_problems(model, "vllm")
    assert problems and all("mlp:own_activation is not implemented by kernels: vllm" in p for p in problems), problems


def test_a_second_mlp_beside_the_moe_is_refused_as_a_sublayer_not_read_as_a_norm():
    """Granite-MoE-Shared with a shared MLP: a child of the decoder layer beside its MoE that the layer forward
    would drop; C0 names it as such."""
    if "granitemoeshared" not in CONFIG_MAPPING:
        pytest.skip("no granitemoeshared in this transformers")
    model = build_meta(CONFIG_MAPPING["granitemoeshared"](**SMALL, shared_intermediate_size=32).to_dict())
    problems = coverage_problems(model, "consistent")
    assert any("shared_mlp" in p and "a sublayer beside the attention and the MLP" in p for p in problems), problems
    assert not any("shared_mlp" in p and "a norm computing" in p for p in problems), problems


@pytest.mark.parametrize("model_type, what", sorted(REFUSED.items()))
def test_a_refused_architecture_names_what_the_wrappers_lack(model_type, what):
    try:
        model = small(model_type)
    except TicInputError as e:  # a config this release's model class cannot build small: not a coverage question
        pytest.skip(str(e))
    problems = coverage_problems(model, "consistent")
    assert problems and any(what in p for p in problems), (model_type, problems)


# ---- routed experts: their stored layout read from their own forward ------------------------------------------
def moe_experts(model):
    return next(m for n, m in model.named_modules() if n.endswith("mlp.experts"))


def test_experts_stored_as_in_out_are_read_as_transposed_views_and_climb_c2_to_c7(tmp_path, monkeypatch, one_thread):
    """Aria stores each routed expert as (in, out) (transformers' `is_transposed`), so [E, H, 2I], not [E, 2I, H]:
    the wrappers take transposed views of those parameters, and a generated Aria-text model passes C2-C7 on the
    consistent kernels (before, C2-C7 ended in a shape error inside the MoE wrapper)."""
    import json

    from tic.config.schema import load_config
    from tic.gates import get
    from tic.harness.engines import hf
    from tic.skill.context import GateContext
    from tic.skill.runner import run_gate

    if "aria_text" not in CONFIG_MAPPING:
        pytest.skip("no aria_text in this transformers")
    model_dir = tmp_path / "aria"
    model_dir.mkdir()
    cfg = CONFIG_MAPPING["aria_text"](**{**SMALL, "vocab_size": 256}, pad_token_id=0, bos_token_id=1,
                                      eos_token_id=2).to_dict()
    (model_dir / "config.json").write_text(json.dumps({**cfg, "dtype": "float32"}, default=str))
    (model_dir / "tic.yaml").write_text(
        "model: {path: ., dtype: float32, generate: {seed: 0}}\n" + SMALL_LADDER)
    experts = moe_experts(build_meta(cfg))
    assert experts.is_transposed and experts.gate_up_proj.shape[1] == SMALL["hidden_size"]
    monkeypatch.chdir(model_dir)
    hf._MODELS.clear()
    ctx = GateContext(load_config(model_dir / "tic.yaml"))
    for gate in ("C0", "C2", "C3", "C4", "C5", "C6", "C7"):
        res = run_gate(get(gate), ctx)
        assert res.verdict == "pass", (gate, res.reason)
    hf._MODELS.clear()


def test_experts_read_without_their_layout_are_refused(monkeypatch):
    """Planted: the wrappers' reading ignores `is_transposed`; Aria's experts then compute something else than
    what the wrappers would compute from those weights: C0 reads them as experts of the model's own (run as they
    are, moe:own_experts), never as SwiGLU from misread weights, and kernels: vllm names them."""
    from tic.harness.kernels import coverage

    if "aria_text" not in CONFIG_MAPPING:
        pytest.skip("no aria_text in this transformers")
    model = small("aria_text")
    assert coverage.experts_compute_swiglu(moe_experts(model)) is True
    monkeypatch.setattr(coverage, "expert_weights", lambda ex: (ex.gate_up_proj, ex.down_proj))
    monkeypatch.setattr(coverage, "_SWIGLU_READINGS", {})
    classes = {k for cov in coverage.read_coverage(model) for k in cov.classes}
    assert "moe:own_experts" in classes and "moe:topk_silu" not in classes, classes
    problems = coverage_problems(model, "vllm")
    assert any("moe:own_experts is not implemented by kernels: vllm" in p for p in problems), problems


def test_experts_with_interleaved_gate_and_up_are_refused_whatever_they_declare():
    """Planted: experts that declare the standard layout but take gate and up from alternate columns (GPT-OSS's
    storage) and square shapes, so only the values can tell: never read as SwiGLU from their weights (the
    consistent kernels run them as they are, moe:own_experts; kernels: vllm refuses them). The same experts
    computing [gate | up] halves are read as the wrappers' SwiGLU (the control)."""
    import torch.nn.functional as F

    from tic.harness.kernels import coverage

    model = small("qwen3_moe")
    experts = moe_experts(model)
    base = type(experts)

    def experts_splitting(split):
        """The experts class computing SwiGLU with gate and up taken from [gate; up]'s output by `split`."""

        class Split(base):
            def forward(self, hidden_states, top_k_index, top_k_weights):
                out = hidden_states.new_zeros(hidden_states.shape)
                for t in range(hidden_states.shape[0]):
                    for s in range(top_k_index.shape[1]):
                        e = int(top_k_index[t, s])
                        gate, up = split(self.gate_up_proj[e] @ hidden_states[t])
                        out[t] += top_k_weights[t, s] * (self.down_proj[e] @ (F.silu(gate) * up))
                return out

        return Split

    interleaved = experts_splitting(lambda gu: (gu[0::2], gu[1::2]))
    halves = experts_splitting(lambda gu: gu.chunk(2))
    for cls, covered in ((interleaved, False), (halves, True)):
        for m in model.modules():
            if type(m) in (base, interleaved, halves):
                m.__class__ = cls
        coverage._SWIGLU_READINGS.clear()
        coverage._PER_TOKEN_READINGS.clear()
        classes = {k for cov in coverage.read_coverage(model) for k in cov.classes}
        assert ("moe:topk_silu" in classes) == covered and ("moe:own_experts" in classes) != covered, classes
        assert (coverage_problems(model, "vllm") == []) == covered, cls


def test_the_experts_reading_copies_a_few_experts_of_a_real_shape():
    """Qwen3-30B-A3B's experts (128 of them, hidden 2048, 768 wide) on the meta device: the reading copies three
    experts, not the layer's 400 M parameters, and reads them as covered."""
    from tic.harness.kernels import coverage

    cfg = CONFIG_MAPPING["qwen3_moe"](hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                                      num_experts_per_tok=8, num_hidden_layers=1, num_attention_heads=32,
                                      num_key_value_heads=4, head_dim=128, vocab_size=256).to_dict()
    experts = moe_experts(build_meta(cfg))
    assert experts.gate_up_proj.is_meta and experts.gate_up_proj.shape == (128, 1536, 2048)
    probe = coverage.few_experts(experts, 3)
    assert probe.gate_up_proj.shape == (3, 1536, 2048) and probe.num_experts == 3 and experts.num_experts == 128
    coverage._SWIGLU_READINGS.clear()
    assert coverage.experts_compute_swiglu(experts) is True


@pytest.mark.parametrize("renormalize", [False, True])
def test_a_routers_rule_is_read_where_its_top_k_holds_nearly_all_the_probability(renormalize):
    """Five of seven experts (FlexOlmo's defaults): on seeded weights the softmax is so peaked that the top five
    sum to about one, and both rules give the same weights. The reading spreads the softmax until one rule alone
    fits (the old one answered "renormalised" first, so a FlexOlmo model, which keeps its top-k probabilities as
    they are, ran renormalised MoE weights and C2 parted at layer 0's MoE block)."""
    from tic.harness.kernels.coverage import moe_router, router_renormalizes

    model = build_meta(CONFIG_MAPPING["qwen3_moe"](**{**SMALL, "num_experts": 7, "num_local_experts": 7,
                                                      "num_experts_per_tok": 5},
                                                   norm_topk_prob=renormalize).to_dict())
    block = next(m for m in model.modules() if moe_router(m) is not None)
    assert router_renormalizes(moe_router(block)) is renormalize


def test_an_output_projection_the_query_heads_do_not_fit_is_refused_at_c0():
    """transformers' Helium (5.25) sizes o_proj hidden -> hidden, so at head_dim * heads != hidden its own forward
    fails, and C2-C7 ended in a shape error after C0 had passed. C0 now compares what the query heads give with
    what the output projection takes. Planted: a Qwen3 attention given such an o_proj. Control: Qwen3 itself at
    head_dim * heads != hidden (o_proj sized from the heads) is covered."""
    import torch.nn as nn

    cfg = dict(SMALL, head_dim=32)  # 4 heads of 32: 128 query features, hidden 64
    control = build_meta(CONFIG_MAPPING["qwen3"](**cfg).to_dict())
    assert coverage_problems(control, "consistent") == []
    planted = build_meta(CONFIG_MAPPING["qwen3"](**cfg).to_dict())
    with torch.device("meta"):
        planted.model.layers[1].self_attn.o_proj = nn.Linear(64, 64, bias=False)
    problems = coverage_problems(planted, "consistent")
    assert problems == ["model.layers.1.self_attn.o_proj (Linear): takes 64 features, where the query heads give 128 "
                        "(head_dim 32): the attention's output does not fit its output projection (config "
                        "head_dim=32)"], problems


def test_the_final_norm_is_found_where_the_causal_lm_is_its_own_base_model():
    """Llama-4's text model answers base_model with itself: its final norm is its `model`'s, not a missing one (C0
    refused it as 'no final norm' before)."""
    model = small("llama4_text")
    assert model.base_model is model
    assert final_norm(model) is model.model.norm
    assert not any("no final norm" in p for p in coverage_problems(model, "consistent"))
