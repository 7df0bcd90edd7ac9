"""An attention output gated before its output projection (Laguna: softplus of g_proj(x), one gate per head or per
feature; AFMoE: sigmoid of gate_proj(x) per feature): read from the attention's own forward at C0, run by the
wrappers' output_gate op, and Laguna climbing C0-C7; the gate's function planted wrong fails C2 at the attention,
and a gate the forward uses otherwise is refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import CONFIG_MAPPING

from tic.harness.engines import hf
from tic.harness.kernels import coverage
from tic.harness.kernels.autograd import gate_output_ref
from tic.harness.kernels.consistent_cpu import CPUProvider
from tic.harness.model.layer_structure import build_meta

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
from tic_small_ladder import assert_c2_parts_at, assert_climbs, small_ladder_ctx  # noqa: E402

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
             eos_token_id=2, tie_word_embeddings=False)
LAGUNA = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, layer_types=["full_attention"] * 2,
              mlp_layer_types=["dense", "sparse"], sliding_window=8)


def config(model_type: str, **changes):
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"no {model_type} in this transformers")
    return CONFIG_MAPPING[model_type](**{**SMALL, **changes})


def attentions(model):
    return [m for m in model.modules() if coverage.is_attention(m)]


@pytest.mark.parametrize("gating,per_head", [(True, True), ("per-element", False)])
def test_c0_reads_lagunas_softplus_gate_per_head_or_per_feature(gating, per_head):
    model = build_meta(config("laguna", **LAGUNA, gating=gating).to_dict())
    assert [coverage.output_gate_reading(a) for a in attentions(model)] == [("g_proj", "softplus", per_head)] * 2
    assert coverage.coverage_problems(model, "consistent") == []
    classes = {c for row in coverage.coverage_table(model) for c in row["operator_classes"]}
    assert "attention:output_gate" in classes


def test_c0_reads_afmoes_sigmoid_gate_per_feature():
    model = build_meta(config("afmoe").to_dict())
    assert {coverage.output_gate_reading(a) for a in attentions(model)} == {("gate_proj", "sigmoid", False)}


def test_an_attention_without_a_gate_reads_none():
    model = build_meta(config("qwen3").to_dict())
    assert coverage.output_gate_reading(attentions(model)[0]) is None


def test_a_gate_the_forward_uses_otherwise_is_refused(monkeypatch):
    """Laguna's forward with another function on its gate (tanh): no rule of the wrappers, so g_proj is a submodule
    they do not run."""
    monkeypatch.setattr(torch.nn.functional, "softplus", torch.tanh)
    model = build_meta(config("laguna", **LAGUNA).to_dict())
    assert coverage.output_gate_reading(attentions(model)[0]) is None
    assert any("submodules the wrappers do not run (g_proj)" in p
               for p in coverage.coverage_problems(model, "consistent"))


def test_the_cpu_kernel_gates_each_row_as_the_whole_batch_reference_does():
    g = torch.randn(5, 3, 4, dtype=torch.bfloat16)
    y = torch.randn(5, 3, 64, dtype=torch.bfloat16)
    for function in ("sigmoid", "softplus"):
        one = CPUProvider().output_gate(g, y, function, True)
        assert torch.equal(one, gate_output_ref(g, y, function, True))
        assert torch.equal(CPUProvider().output_gate(g[2:3], y[2:3], function, True), one[2:3])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_laguna_climbs_the_ladder(tmp_path, monkeypatch, one_thread, dtype):
    assert_climbs(small_ladder_ctx(tmp_path, monkeypatch, config("laguna", **LAGUNA), dtype))


def test_a_gate_run_with_the_wrong_function_parts_from_the_stock_model(tmp_path, monkeypatch, one_thread):
    """Planted: the wrappers gate Laguna's attention with sigmoid instead of softplus. C2 names the attention."""
    ctx = small_ladder_ctx(tmp_path, monkeypatch, config("laguna", **LAGUNA), "float32")
    try:
        for attn in attentions(ctx.train_engine().model):
            name, _, per_head = attn._tic_output_gate
            attn._tic_output_gate = (name, "sigmoid", per_head)
        assert_c2_parts_at(ctx, ".self_attn")
    finally:
        hf._MODELS.clear()
