"""Attention sinks (GPT-OSS's `sinks`, also Flint's and Granite-SWA's): one learned logit per head beside every
row's keys, in the softmax and dropped from it. Read by C0 (`attention:sinks`), computed by the consistent
kernels, checked against the stock model (C2), across layouts and decode (C3-C6), and trained (C7: the sinks are
parameters with a gradient of their own)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import CONFIG_MAPPING

from tic.gates import get
from tic.harness.engines import hf
from tic.harness.kernels import autograd, consistent_cpu, coverage
from tic.harness.model.layer_structure import build_meta
from tic.skill.runner import run_gate

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
from tic_small_ladder import assert_c2_parts_at, small_ladder_ctx  # noqa: E402

# two dense layers of Flint (its MoE layers: tests/test_score_routers.py): attention with sinks and q/k norms
FLINT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, layer_types=["full_attention"] * 2,
             tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def flint_config():
    if "flint" not in CONFIG_MAPPING:
        pytest.skip("no flint in this transformers")
    return CONFIG_MAPPING["flint"](**FLINT)


def test_the_rowwise_kernel_and_the_reference_agree_and_the_sinks_take_a_share():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 5, 8, generator=g) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    sinks = torch.randn(4, generator=g)
    got = consistent_cpu.rowwise_attention(None, q, k, v, None, 0.3, sinks=sinks)[0]
    want = autograd.attention_sinks_ref(q, k, v, None, sinks, 0.3)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    plain = consistent_cpu.rowwise_attention(None, q, k, v, None, 0.3)[0]
    assert not torch.allclose(got, plain)  # the sink's share is taken from every row
    assert torch.allclose(autograd.attention_sinks_ref(q, k, v, None, torch.full((4,), -1e9), 0.3),
                          autograd.attention_ref(q, k, v, None, 0.3), rtol=1e-5, atol=1e-6)


def test_c0_reads_the_sinks_and_vllms_kernels_refuse_them():
    model = build_meta(flint_config().to_dict())
    classes = {k for cov in coverage.read_coverage(model) for k in cov.classes}
    assert "attention:sinks" in classes and coverage.coverage_problems(model, "consistent") == []
    problems = coverage.coverage_problems(model, "vllm")
    assert any("attention:sinks is not implemented by kernels: vllm" in p for p in problems), problems


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_attention_with_sinks_climbs_c0_to_c7(tmp_path, monkeypatch, one_thread, dtype):
    """bf16 too. Flint keeps its sinks, its attention's first parameter, in float32: the probe that reads whether
    a layer applies the rotary built its rows in that dtype, q_proj refused them, and Flint's NoPE layers were read
    as rotary (C2 then found the attention parting, by far more than rounding). It takes q_proj's dtype now."""
    ctx = small_ladder_ctx(tmp_path, monkeypatch, flint_config(), dtype)
    try:
        for gate in ("C0", "C2", "C3", "C4", "C5", "C6", "C7"):
            res = run_gate(get(gate), ctx)
            assert res.verdict == "pass", (gate, res.reason)
        assert all(layer.self_attn._tic_sinks for layer in ctx.rollout_engine().model.model.layers)
    finally:
        hf._MODELS.clear()


def test_wrappers_that_drop_the_sinks_part_from_the_stock_model(tmp_path, monkeypatch, one_thread):
    """Planted: the wrappers' attention without the sinks. C2 names the attention. Control: the climb above."""
    ctx = small_ladder_ctx(tmp_path, monkeypatch, flint_config(), "float32")
    try:
        for engine in (ctx.rollout_engine(), ctx.train_engine()):
            for layer in engine.model.model.layers:
                layer.self_attn._tic_sinks = False
        assert_c2_parts_at(ctx, ".self_attn")
    finally:
        hf._MODELS.clear()


def test_sinks_with_an_fp8_kv_cache_are_refused_in_one_line():
    """The consistent kernels' FP8 KV-cache attention has no sinks: wrapping such a model is refused (C0's
    TicInputError, exit 2), never an error inside a gate."""
    from tic.core.errors import TicInputError
    from tic.harness.kernels.consistent_cpu import CPUProvider
    from tic.harness.kernels.modules import apply
    from tic.harness.model.layer_structure import model_from_config

    model = model_from_config(flint_config(), dtype=torch.float32)
    with pytest.raises(TicInputError, match="attention sinks with an FP8 KV cache"):
        apply(model, CPUProvider(kv_cache_dtype="fp8"))


def test_the_qk_norm_probe_takes_its_rows_dtype_from_q_proj_not_from_a_float32_parameter(monkeypatch):
    """transformers keeps Flint's sinks in float32 in a bf16 model, and they are its attention's first parameter:
    the probe that places the q/k norms against the rotary built its rows in float32 from them, q_proj refused
    them, and C0 refused the model. Control: the float32 model reads the same."""
    from tic.harness.model.layer_structure import model_from_config

    monkeypatch.setattr(coverage, "_QK_INPUTS", {})  # read once per class: read this one afresh
    model = model_from_config(flint_config(), dtype=torch.bfloat16)
    attn = model.model.layers[0].self_attn
    assert next(attn.parameters()).dtype == torch.float32 and attn.q_proj.weight.dtype == torch.bfloat16
    assert coverage.qk_norm_after_rotary(attn, "q_norm") is False
