"""Multi-head latent attention (tic.harness.kernels.mla): DeepSeek-V3 and the families that build their attention
the same way (GLM-4-MoE-Lite, MiniCPM3, Youtu, Sarvam-MLA, AXK1). Recognised by C0 with its rotary layout read from
the module's own forward, computed by the consistent kernels, checked against the stock model (C2), across
layouts and decode (C3-C6) and in the backward (C7)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from transformers import CONFIG_MAPPING

from tic.gates import get
from tic.harness.engines import hf
from tic.harness.kernels import coverage, mla, modules
from tic.harness.model.layer_structure import build_meta
from tic.skill.context import GateContext
from tic.skill.runner import run_gate

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
from tic_small_ladder import assert_c2_parts_at, small_ladder_ctx  # noqa: E402

# small latent sizes; the value narrower than the key, as in MiniCPM3 and GLM-4-MoE-Lite
SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
             v_head_dim=6, max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)
# MoE families: a softmax-free router needs the score-router settings; one dense layer first
MOE = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
           first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True)
FAMILIES = {"deepseek_v3": MOE, "deepseek_v2": MOE, "glm4_moe_lite": MOE, "minicpm3": {},
            "sarvam_mla": {**MOE, "q_lora_rank": None}, "youtu": {}}


def config(model_type: str, **changes):
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"no {model_type} in this transformers")
    return CONFIG_MAPPING[model_type](**{**SIZES, **FAMILIES.get(model_type, {}), **changes})


def mla_ctx(tmp_path, monkeypatch, cfg, dtype: str) -> GateContext:
    """A generated model of cfg under the small ladder, MoE routers drawn (small_ladder_ctx)."""
    return small_ladder_ctx(tmp_path, monkeypatch, cfg, dtype)


@pytest.mark.parametrize("model_type, changes, layout", [
    ("deepseek_v3", {}, "pairs"),  # rope_interleave: pairs turned, written back as halves (the same attention)
    ("deepseek_v3", {"rope_interleave": False}, "neox"),
    ("minicpm3", {}, "neox"),
    ("glm4_moe_lite", {}, "pairs"),
    ("sarvam_mla", {}, "pairs"),  # q_proj without a low-rank query
    ("deepseek_v2", {}, "pairs"),  # its rotary handed over as complex numbers
])
def test_the_rotary_layout_is_read_from_the_attentions_own_forward(model_type, changes, layout):
    model = build_meta(config(model_type, **changes).to_dict())
    attn = model.model.layers[0].self_attn
    assert mla.is_mla_attention(attn) and not coverage.is_attention(attn)
    assert mla.rope_layout(attn, coverage.seeded_copy) == (layout, None)
    assert coverage.coverage_problems(model, "consistent") == []


def test_a_latent_attention_rotating_otherwise_is_refused_in_one_line(monkeypatch):
    """Planted: the module's forward rotates its rotary features by twice the angles, neither layout the wrapper
    computes: C0 names the attention. Control: the reading above."""
    model = build_meta(config("deepseek_v3").to_dict())
    cls = type(model.model.layers[0].self_attn)
    forward = cls.forward
    monkeypatch.setattr(mla, "_READINGS", {})  # read once per class and shapes: the control above read this one

    def doubled(self, hidden_states, position_embeddings, attention_mask, *args, **kwargs):
        cos, sin = position_embeddings
        return forward(self, hidden_states, (cos * cos - sin * sin, 2 * sin * cos), attention_mask, *args, **kwargs)

    monkeypatch.setattr(cls, "forward", doubled)
    problems = coverage.coverage_problems(model, "consistent")
    assert len(problems) == 1 and "self_attn (DeepseekV3Attention)" in problems[0], problems
    assert "rotary turns neither the two halves (neox) nor pairs" in problems[0], problems


def test_vllms_kernels_refuse_a_latent_attention_in_one_line():
    """vLLM runs MLA through kernels of its own (absorbed weights, its MLA backends) that the wrappers do not call
    yet: kernels: vllm refuses the attention in a line (MiniCPM3 also for its hidden-state scaling)."""
    model = build_meta(config("minicpm3").to_dict())
    problems = coverage.coverage_problems(model, "vllm")
    assert any("attention:mla is not implemented by kernels: vllm" in p for p in problems), problems
    assert all("is not implemented by kernels: vllm" in p for p in problems), problems


@pytest.mark.parametrize("model_type, dtype", [("deepseek_v3", "float32"), ("deepseek_v3", "bfloat16"),
                                               ("minicpm3", "float32"), ("glm4_moe_lite", "float32"),
                                               ("sarvam_mla", "float32"), ("deepseek_v2", "float32")])
def test_a_latent_attention_climbs_c0_to_c7(tmp_path, monkeypatch, one_thread, model_type, dtype):
    ctx = mla_ctx(tmp_path, monkeypatch, config(model_type), dtype)
    try:
        for gate in ("C0", "C2", "C3", "C4", "C5", "C6", "C7"):
            res = run_gate(get(gate), ctx)
            assert res.verdict == "pass", (gate, res.reason)
        attn = ctx.rollout_engine().model.model.layers[0].self_attn
        assert attn.forward.__func__ is modules._mla_attention_forward
    finally:
        hf._MODELS.clear()


@pytest.mark.parametrize("plant", ["other layout", "no latent norm"])
def test_a_wrapper_that_computes_another_attention_parts_from_the_stock_model(tmp_path, monkeypatch, one_thread,
                                                                               plant):
    """Planted: the wrappers rotate by the other layout, or skip the latent's norm. C2's fidelity check names the
    attention. Control: the climb above."""
    ctx = mla_ctx(tmp_path, monkeypatch, config("deepseek_v3"), "float32")
    try:
        for engine in (ctx.rollout_engine(), ctx.train_engine()):
            for layer in engine.model.model.layers:
                attn = layer.self_attn
                if plant == "other layout":
                    attn._tic_mla_layout = "neox"
                else:
                    attn.kv_a_layernorm.forward = lambda x: x
        assert_c2_parts_at(ctx, ".self_attn")
    finally:
        hf._MODELS.clear()


def test_minicpm3s_residual_scale_is_read_and_dropping_it_parts_from_the_stock_model(tmp_path, monkeypatch,
                                                                                       one_thread):
    """MiniCPM3 scales each sublayer's output by `residual_scale` before its residual add (Granite's
    residual_multiplier under another name) and divides the last hidden states by a read-only logits_scaling
    (its model's own forward does, before lm_head). Planted: a reading that knows Granite's name only leaves the
    scale out, and C2 parts from the stock model. Control: MiniCPM3's climb above."""
    model = build_meta(config("minicpm3").to_dict())
    classes = {k for cov in coverage.read_coverage(model) for k in cov.classes}
    assert {"decoder:scaled_residual", "logits:hidden_scaled_by_model"} <= classes
    monkeypatch.setattr(coverage, "RESIDUAL_SCALE_NAMES", ("residual_multiplier",))
    ctx = mla_ctx(tmp_path, monkeypatch, config("minicpm3"), "float32")
    try:
        assert run_gate(get("C0"), ctx).verdict == "pass"
        res = run_gate(get("C2"), ctx)
        assert res.verdict == "fail", res.reason
    finally:
        hf._MODELS.clear()
