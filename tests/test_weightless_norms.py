"""Norms read by what they compute, weight or none, epsilon included (OLMo's weightless float32 LayerNorm with a
hard-coded 1e-5, nanochat's weightless RMSNorm, per head on q and k), and a rotary turned the other way (nanochat's
rotate_half with its signs flipped): C0 reads them, the wrappers run them, both models climb C0-C7, and the rotary
planted back to the usual direction fails C2 at the attention."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import CONFIG_MAPPING

from tic.harness.engines import hf
from tic.harness.kernels import coverage, norms
from tic.harness.kernels.consistent_cpu import CPUProvider
from tic.harness.kernels.modules import apply
from tic.harness.model.layer_structure import build_meta, model_from_config

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
from tic_small_ladder import assert_c2_parts_at, assert_climbs, small_ladder_ctx  # noqa: E402

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def config(model_type: str, **changes):
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"no {model_type} in this transformers")
    return CONFIG_MAPPING[model_type](**{**SMALL, **changes})


def small_rows(width: int) -> torch.Tensor:
    """Rows whose mean square (about 2e-6) is near the usual epsilons, where a wrong one changes the output."""
    return torch.linspace(-2.0, 3.0, 3 * width).reshape(3, width) * 1e-3


def test_c0_reads_olmos_weightless_layernorm_and_its_hard_coded_epsilon():
    model = build_meta(config("olmo").to_dict())
    assert coverage.coverage_problems(model, "consistent") == []
    rows = {r["layer"]: r for r in coverage.coverage_table(model)}
    assert "norm:layer" in rows["model.layers.0"]["operator_classes"]
    readings = {n: r for cov in coverage.read_coverage(model) for n, r in cov.readings.items()}
    # OlmoLayerNorm holds no epsilon; its forward passes 1e-5 (the wrappers' default would be 1e-6)
    assert readings["model.layers.0.input_layernorm"]["eps"] == 1e-5
    assert readings["model.norm"]["eps"] == 1e-5


def test_c0_reads_nanochats_weightless_per_head_qk_norms_and_reversed_rotary():
    model = build_meta(config("nanochat").to_dict())
    assert coverage.coverage_problems(model, "consistent") == []
    classes = {c for row in coverage.coverage_table(model) for c in row["operator_classes"]}
    assert {"attention:qk_norm", "attention:qk_norm_after_rotary", "rope:reversed", "norm:rms"} <= classes
    qwen3 = build_meta(config("qwen3", head_dim=16).to_dict())
    assert "rope:reversed" not in {c for row in coverage.coverage_table(qwen3) for c in row["operator_classes"]}


class HardCodedEpsRMSNorm(nn.Module):
    """An RMSNorm that holds one epsilon and computes with another (its forward's own constant)."""

    def __init__(self, width: int, held: float, used: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.variance_epsilon, self.used = held, used

    def forward(self, x):
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.used)).to(x.dtype)


def test_an_epsilon_the_forward_hard_codes_is_read_and_run_by_the_wrappers():
    """The module holds 1e-6 and computes with 1e-5: on rows of small mean square the wrapped model's norm gives
    the module's own output, not the one at the epsilon it holds."""
    torch.manual_seed(0)
    model = model_from_config(config("qwen3", head_dim=16), dtype=torch.float32)
    for layer in model.model.layers:
        norm = HardCodedEpsRMSNorm(64, held=1e-6, used=1e-5)
        norm.weight.data.copy_(torch.rand(64) + 0.5)
        layer.input_layernorm = norm
    assert norms.read_norm_eps(model.model.layers[0].input_layernorm, "norm:rms") == 1e-5
    x = small_rows(64)
    stock = model.model.layers[0].input_layernorm(x)
    apply(model, CPUProvider())
    wrapped = model.model.layers[0].input_layernorm(x)
    assert torch.allclose(wrapped, stock, rtol=1e-6, atol=0)


def test_a_norm_whose_epsilon_is_none_of_the_usual_is_refused_in_one_line():
    torch.manual_seed(0)
    model = model_from_config(config("qwen3", head_dim=16), dtype=torch.float32)
    model.model.layers[0].input_layernorm = HardCodedEpsRMSNorm(64, held=1e-6, used=3e-6)
    problems = coverage.coverage_problems(model, "consistent")
    assert len(problems) == 1 and "model.layers.0.input_layernorm" in problems[0] and "epsilon" in problems[0]


def test_a_norm_that_normalises_otherwise_is_still_refused():
    class MeanOnlyNorm(nn.Module):  # centres, does not scale: no variant the wrappers implement
        def forward(self, x):
            return x - x.mean(-1, keepdim=True)

    torch.manual_seed(0)
    model = model_from_config(config("qwen3", head_dim=16), dtype=torch.float32)
    model.model.layers[1].post_attention_layernorm = MeanOnlyNorm()
    problems = coverage.coverage_problems(model, "consistent")
    assert len(problems) == 1 and "model.layers.1.post_attention_layernorm (MeanOnlyNorm)" in problems[0]


@pytest.mark.parametrize("model_type,dtype", [("olmo", "float32"), ("olmo", "bfloat16"), ("nanochat", "float32"),
                                              ("nanochat", "bfloat16")])
def test_weightless_norm_models_climb_the_ladder(tmp_path, monkeypatch, one_thread, model_type, dtype):
    assert_climbs(small_ladder_ctx(tmp_path, monkeypatch, config(model_type), dtype))


def test_the_rotary_turned_the_usual_way_parts_from_nanochat_at_the_attention(tmp_path, monkeypatch, one_thread):
    """Planted: the wrappers' table keeps +sin, so they turn q and k the usual way. C2 names the attention."""
    ctx = small_ladder_ctx(tmp_path, monkeypatch, config("nanochat"), "float32")
    try:
        for m in ctx.train_engine().model.modules():
            for rope in getattr(m, "_tic_ropes", {}).values():
                rope.reversed, rope.table = False, None
        assert_c2_parts_at(ctx, ".self_attn")
    finally:
        hf._MODELS.clear()
