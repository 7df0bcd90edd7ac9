"""An ungated MLP whose activation is a module of the model's own (Apertus' xIELU: learned alpha_p, alpha_n): C0
reads that it acts on each token's row alone, the consistent kernels run it one row at a time (row-invariant by
construction) and autograd trains its parameters; an activation that mixes rows is refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import CONFIG_MAPPING

from tic.harness.engines import hf
from tic.harness.kernels import coverage
from tic.harness.model.layer_structure import build_meta

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
from tic_small_ladder import assert_c2_parts_at, assert_climbs, small_ladder_ctx  # noqa: E402

APERTUS = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def apertus_config():
    if "apertus" not in CONFIG_MAPPING:
        pytest.skip("no apertus in this transformers")
    return CONFIG_MAPPING["apertus"](**APERTUS)


def test_c0_reads_the_models_own_activation_and_vllms_kernels_refuse_it():
    model = build_meta(apertus_config().to_dict())
    assert coverage.coverage_problems(model, "consistent") == []
    classes = {k for cov in coverage.read_coverage(model) for k in cov.classes}
    assert "mlp:own_activation" in classes
    assert any("mlp:own_activation is not implemented by kernels: vllm" in p
               for p in coverage.coverage_problems(model, "vllm"))


def test_an_activation_that_mixes_rows_is_refused():
    class Centered(nn.Module):  # each row minus the batch's mean: not a function of the row alone
        def forward(self, x):
            return torch.relu(x - x.mean(dim=0, keepdim=True))

    assert not coverage.acts_per_row(Centered())
    assert coverage.acts_per_row(nn.GELU()) and coverage.acts_per_row(nn.Softmax(dim=-1))


@pytest.mark.parametrize("dtype, gates", [("float32", "C0 C2 C3 C4 C5 C6 C7"), ("bfloat16", "C0 C2 C3 C4 C5 C6")])
def test_apertus_climbs_the_ladder(tmp_path, monkeypatch, one_thread, dtype, gates):
    """bf16 stops at C6: on this generated model's inputs layer 0's alpha_n gradient (1e-4 of the largest) is
    0.23 off the float32 reference in bf16, past C7's 0.1 (bf16 noise on a tiny gradient; open)."""
    res = assert_climbs(small_ladder_ctx(tmp_path, monkeypatch, apertus_config(), dtype), gates)
    if res.gate == "C7":  # the activation's own parameters are trained, and checked, like every other
        trained = {t["parameter"] for t in res.details["tensors"]}
        assert {f"model.layers.{i}.mlp.act_fn.{a}" for i in (0, 1) for a in ("alpha_p", "alpha_n")} <= trained


def test_wrappers_that_replace_the_activation_part_from_the_stock_model(tmp_path, monkeypatch, one_thread):
    """Planted: the wrappers run torch's SiLU where the model runs its xIELU. C2 names the MLP."""
    ctx = small_ladder_ctx(tmp_path, monkeypatch, apertus_config(), "float32")
    try:
        for layer in ctx.train_engine().model.model.layers:
            up, down, _ = layer.mlp._tic_plain
            layer.mlp._tic_plain = (up, down, "silu")
        assert_c2_parts_at(ctx, ".mlp")
    finally:
        hf._MODELS.clear()
