"""A fused query_key_value under a partial rotary (Persimmon): the layout probe reads the split through the model's
own forward, which slices each head's rotary part itself."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import PersimmonConfig

from tic.harness.kernels import coverage
from tic.harness.model.layer_structure import build_meta

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
from tic_small_ladder import assert_climbs, small_ladder_ctx  # noqa: E402


def test_a_fused_qkv_under_a_partial_rotary_is_read_and_climbs(tmp_path, monkeypatch, one_thread):
    """Persimmon slices each head's rotary part itself (rotary_ndims), so the layout probe's identity table must
    be as wide as that part, not the head: read so, its fused query_key_value splits and the model climbs C0-C7."""
    config = PersimmonConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, max_position_embeddings=256, qk_layernorm=False,
                             pad_token_id=0, bos_token_id=1, eos_token_id=2)
    attn = build_meta(config.to_dict()).model.layers[0].self_attn
    q, k, v = coverage.fused_qkv_layout(attn)
    assert attn.rotary_ndims < coverage.head_dim_of(attn) and q.numel() == k.numel() == v.numel() == 64
    assert sorted(torch.cat([q, k, v]).tolist()) == list(range(192))
    ctx = small_ladder_ctx(tmp_path, monkeypatch, config, "float32")
    assert_climbs(ctx)


def test_persimmons_qk_layernorms_after_a_fused_qkv_are_read_and_climb(tmp_path, monkeypatch, one_thread):
    """Persimmon's default: one LayerNorm shared by q's heads (and one by k's) between the fused query_key_value's
    split and the partial rotary. The layout probe hands the split through those norms unchanged; read so, the
    model climbs C0-C7. Planted: the wrapped attention skips the q/k norms, agrees with itself bitwise, and C2 names
    the attention."""
    from tic.gates import get
    from tic.harness.engines import hf
    from tic.skill.runner import run_gate

    config = PersimmonConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                             eos_token_id=2)
    assert config.qk_layernorm
    attn = build_meta(config.to_dict()).model.layers[0].self_attn
    q, k, v = coverage.fused_qkv_layout(attn)
    assert sorted(torch.cat([q, k, v]).tolist()) == list(range(192))
    assert coverage.qk_norm_after_rotary(attn, "q_layernorm") is False
    ctx = small_ladder_ctx(tmp_path, monkeypatch, config, "float32")
    assert_climbs(ctx)
    for m in ctx.train_engine().model.modules():
        if getattr(m, "_tic_qk_norms", None):
            m._tic_qk_norms = None
    try:
        res = run_gate(get("C2"), ctx)
        assert res.verdict == "fail" and ".self_attn" in res.details["fidelity"]["first_parting_module"], res.reason
    finally:
        hf._MODELS.clear()
