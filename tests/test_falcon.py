"""Falcon: a decoder layer whose attention is named `self_attention`, that returns (output, attention weights) for
its model to index, and whose three generations differ in norms and in the fused query_key_value's layout: one
shared input norm and multi-query (Falcon-7B), two norms of the input side by side and grouped K/V (Falcon-40B's
new decoder architecture), and a sequential two-norm layer with per-head interleaved q/k/v. Each climbs C0-C7 on
the consistent kernels; ALiBi is refused at C0 in one line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import FalconConfig

from tic.core.errors import TicInputError
from tic.harness.engines import hf
from tic.harness.kernels import coverage
from tic.harness.kernels.consistent_cpu import CPUProvider
from tic.harness.kernels.modules import apply
from tic.harness.model.layer_structure import build_meta, model_from_config

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
from tic_small_ladder import assert_c2_parts_at, assert_climbs, small_ladder_ctx  # noqa: E402

BASE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_hidden_size=128,
            max_position_embeddings=256, bias=False, alibi=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
GENERATIONS = {
    "7b: one input norm, multi-query": dict(multi_query=True, parallel_attn=True),
    "40b: two norms side by side, grouped K/V": dict(new_decoder_architecture=True, num_kv_heads=2),
    "sequential, interleaved q/k/v, biases": dict(parallel_attn=False, multi_query=False, bias=True),
}
STRUCTURE = {"7b: one input norm, multi-query": "decoder:parallel",
             "40b: two norms side by side, grouped K/V": "decoder:parallel_two_norm",
             "sequential, interleaved q/k/v, biases": "decoder:two_norm"}


def falcon(**kw) -> FalconConfig:
    return FalconConfig(**{**BASE, **kw})


@pytest.mark.parametrize("generation", list(GENERATIONS))
def test_c0_reads_each_generations_layer(generation):
    model = build_meta(falcon(**GENERATIONS[generation]).to_dict())
    covs = coverage.read_coverage(model)
    assert coverage.coverage_problems(model, "consistent") == []
    assert {v for cov in covs for v in cov.variants.values()} >= {STRUCTURE[generation]}
    assert coverage.attention_name(model.transformer.h[0]) == "self_attention"


@pytest.mark.parametrize("generation", list(GENERATIONS))
def test_each_generation_climbs_c0_to_c7(tmp_path, monkeypatch, one_thread, generation):
    ctx = small_ladder_ctx(tmp_path, monkeypatch, falcon(**GENERATIONS[generation]), "float32")
    assert_climbs(ctx)


def test_the_wrapped_layer_returns_what_its_model_indexes():
    """Falcon's model takes outputs[0] of each layer: a wrapped layer returning its output alone would hand the
    next layer the first sequence's rows. The layer's own return is read at C0, with stand-ins for its children."""
    torch.manual_seed(0)
    model = model_from_config(falcon(**GENERATIONS["7b: one input norm, multi-query"]), dtype=torch.float32)
    layer = model.transformer.h[0]
    assert coverage.layer_output_count(layer) == 2
    apply(model, CPUProvider())
    h = torch.randn(2, 3, 64)
    out = layer(h, attention_mask=None, position_ids=torch.arange(3)[None],
                position_embeddings=model.transformer.rotary_emb(h, torch.arange(3)[None]))
    assert isinstance(out, tuple) and len(out) == 2 and out[0].shape == (2, 3, 64) and out[1] is None


def test_the_mlp_on_the_attentions_norm_fails_c2_at_the_layer(tmp_path, monkeypatch, one_thread):
    """Falcon-40B's MLP reads ln_mlp(x), the attention ln_attn(x): the norms are told apart by what each feeds.
    Planted: the wrappers' MLP reads the attention's norm. C2 names the layer's MLP input. Control: the climb."""
    ctx = small_ladder_ctx(tmp_path, monkeypatch, falcon(**GENERATIONS["40b: two norms side by side, grouped K/V"]),
                           "float32")
    try:
        layers = ctx.train_engine().model.transformer.h
        assert [dict(layer._tic_norm_roles) for layer in layers] == \
            [{"input_layernorm": "ln_attn", "post_attention_layernorm": "ln_mlp"}] * len(layers)
        for layer in layers:
            layer._tic_norm_roles["post_attention_layernorm"] = "ln_attn"
        assert_c2_parts_at(ctx, "transformer.h.0")
    finally:
        hf._MODELS.clear()


def test_alibi_is_refused_in_one_line():
    model = model_from_config(falcon(alibi=True, parallel_attn=False, multi_query=False), dtype=torch.float32)
    with pytest.raises(TicInputError, match="ALiBi position biases"):
        apply(model, CPUProvider())
