"""Values of another head size than queries and keys, scaled by a constant (MiMo-V2-Flash: v_head_dim 128 beside a
q/k head_dim of 192, attention_value_scale): read from the attention's own forward at C0, reshaped and scaled by the
wrappers, and climbing C0-C7; the scale planted away fails C2 at the attention."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from transformers import CONFIG_MAPPING

from tic.harness.engines import hf
from tic.harness.kernels import coverage
from tic.harness.model.layer_structure import build_meta

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
from tic_small_ladder import assert_c2_parts_at, assert_climbs, small_ladder_ctx  # noqa: E402

MIMO = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=24, v_head_dim=16, attention_value_scale=0.75, sliding_window=8,
            layer_types=["full_attention", "sliding_attention"], mlp_layer_types=["dense", "dense"],
            max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def mimo_config(**changes):
    if "mimo_v2_flash" not in CONFIG_MAPPING:
        pytest.skip("no mimo_v2_flash in this transformers")
    return CONFIG_MAPPING["mimo_v2_flash"](**{**MIMO, **changes})


def attentions(model):
    return [m for m in model.modules() if coverage.is_attention(m)]


def test_c0_reads_the_value_head_size_and_scale_and_vllms_kernels_refuse_them():
    model = build_meta(mimo_config().to_dict())
    assert [coverage.value_reading(a) for a in attentions(model)] == [(16, 0.75)] * 2
    assert coverage.coverage_problems(model, "consistent") == []
    assert any("attention:value_head is not implemented by kernels: vllm" in p
               for p in coverage.coverage_problems(model, "vllm"))
    qwen3 = build_meta(CONFIG_MAPPING["qwen3"](vocab_size=256, hidden_size=64, num_hidden_layers=1,
                                               num_attention_heads=4, num_key_value_heads=2).to_dict())
    assert coverage.value_reading(attentions(qwen3)[0]) is None  # values as wide as the keys: nothing to read


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mimo_v2_flash_climbs_the_ladder(tmp_path, monkeypatch, one_thread, dtype):
    """bf16 too: the reading probes the model's real bf16 projections then, not the meta copy C0 reads."""
    assert_climbs(small_ladder_ctx(tmp_path, monkeypatch, mimo_config(), dtype))


def test_wrappers_that_drop_the_value_scale_part_from_the_stock_model(tmp_path, monkeypatch, one_thread):
    """Planted: the values reshaped to their own head size but not scaled. C2 names the attention."""
    ctx = small_ladder_ctx(tmp_path, monkeypatch, mimo_config(), "float32")
    try:
        for attn in attentions(ctx.train_engine().model):
            attn._tic_value = (attn._tic_value[0], 1.0)
        assert_c2_parts_at(ctx, ".self_attn")
    finally:
        hf._MODELS.clear()
