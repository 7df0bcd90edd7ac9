"""Routed experts of the model's own (GPT-OSS: a clamped SwiGLU on interleaved gate/up columns, with biases): C0
reads that their forward acts on each token alone and the consistent kernels run it one token at a time; a router
whose logits add a bias of its own; a rotary module that returns each angle once; packed rows of a model whose
masks ignore the position ids. GPT-OSS climbs C0-C7 with all four; each is also planted away."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import CONFIG_MAPPING

from tic.harness.engines import hf
from tic.harness.kernels import coverage, modules, rope
from tic.harness.model.layer_structure import build_meta

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
from tic_small_ladder import assert_c2_parts_at, assert_climbs, small_ladder_ctx  # noqa: E402

GPT_OSS = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
               layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)


def gpt_oss_config():
    if "gpt_oss" not in CONFIG_MAPPING:
        pytest.skip("no gpt_oss in this transformers")
    return CONFIG_MAPPING["gpt_oss"](**GPT_OSS)


def moe_blocks(model):
    return [m for m in model.modules() if coverage.is_moe_block(m)]


class _Experts(nn.Module):
    """Experts in transformers' layout ([E, 2I, H] and [E, H, I]) with a GELU, so not the wrappers' SiLU; `centre`
    subtracts the batch's mean row first, which mixes tokens."""

    def __init__(self, centre: bool):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(3, 16, 8))
        self.down_proj = nn.Parameter(torch.randn(3, 8, 8))
        self.centre = centre

    def forward(self, x, ids, weights):
        x = x - x.mean(dim=0, keepdim=True) if self.centre else x
        out = torch.zeros_like(x)
        for slot in range(ids.shape[1]):
            for e in ids[:, slot].unique().tolist():
                rows = (ids[:, slot] == e).nonzero().flatten()
                gate, up = nn.functional.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
                h = nn.functional.linear(nn.functional.gelu(gate) * up, self.down_proj[e])
                out = out.index_add(0, rows, h * weights[rows, slot, None])
        return out


def test_c0_reads_the_models_own_experts_and_the_vllm_kernels_refuse_them():
    model = build_meta(gpt_oss_config().to_dict())
    assert coverage.coverage_problems(model, "consistent") == []
    classes = {k for cov in coverage.read_coverage(model) for k in cov.classes}
    assert "moe:own_experts" in classes and "moe:topk_silu" not in classes
    assert any("moe:own_experts is not implemented by kernels: vllm" in p
               for p in coverage.coverage_problems(model, "vllm"))


def test_experts_that_mix_tokens_are_refused_and_per_token_ones_read():
    assert coverage.experts_act_per_token(_Experts(centre=False))
    assert not coverage.experts_act_per_token(_Experts(centre=True))


def test_a_router_linear_bias_is_read_as_added_to_the_logits_not_as_a_selection_bias():
    model = build_meta(gpt_oss_config().to_dict())
    router = coverage.moe_router(moe_blocks(model)[0])
    assert coverage.router_logit_bias_name(router) == "bias"
    assert coverage.router_bias(router) is None  # it is in the logits: nothing chooses by it alone
    plain = coverage.moe_router(moe_blocks(build_meta(CONFIG_MAPPING["qwen3_moe"](
        vocab_size=256, hidden_size=64, num_experts=4, num_experts_per_tok=2, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=32).to_dict()))[0])
    assert coverage.router_logit_bias_name(plain) is None


def test_a_rotary_module_returning_each_angle_once_gives_the_same_table():
    model = build_meta(gpt_oss_config().to_dict())
    rotary = coverage.rotary_modules(model)[0][1]
    rotary = rotary.to_empty(device="cpu")  # built on the meta device: real frequencies for its 8 angles
    rotary.inv_freq.copy_(1.0 / 10000 ** (torch.arange(8) / 8))
    assert rope.rotary_output_layout(rotary) == "once"
    cos, sin = rotary(torch.zeros(1), torch.arange(6)[None].float())
    table = rope.hf_cos_sin_cache(rotary, 6, torch.float32, "cpu")
    assert table.shape == (6, 16) and torch.equal(table, torch.cat([cos[0], sin[0]], -1))
    assert torch.equal(rope.hf_cos_sin_cache(rotary, 1, torch.float32, "cpu"), table[:1])


def test_a_packed_row_attends_within_each_sequence_whatever_the_model_hands_its_masks():
    """tic's mask function confines a packed row (position ids that do not step by one) to each sequence from the
    ids of the model's own call, where the model does not hand them to its mask functions itself."""
    from transformers.masking_utils import causal_mask_function

    def mask(positions, **kw):
        token = modules._MODEL_POSITIONS.set(positions)
        try:
            return modules._mask_for_rowwise(batch_size=1, q_length=5, kv_length=5, mask_function=causal_mask_function,
                                             **kw)
        finally:
            modules._MODEL_POSITIONS.reset(token)

    want = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]).bool()
    assert torch.equal(mask(torch.tensor([[0, 1, 2, 0, 1]]))[0, 0], want)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    assert torch.equal(mask(torch.arange(5)[None])[0, 0], causal)  # one sequence
    assert torch.equal(mask(None)[0, 0], causal)  # a call with a cache records none
    padded = torch.tensor([[0, 0, 1, 1, 1]]).bool()  # a padding mask: the row is the padding's business
    assert torch.equal(mask(torch.tensor([[1, 1, 0, 1, 2]]), attention_mask=padded)[0, 0], causal & padded[0])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpt_oss_climbs_the_ladder(tmp_path, monkeypatch, one_thread, dtype):
    res = assert_climbs(small_ladder_ctx(tmp_path, monkeypatch, gpt_oss_config(), dtype))
    trained = {t["parameter"] for t in res.details["tensors"]}  # the experts' own parameters, and the router bias
    assert {"model.layers.0.mlp.experts.gate_up_proj_bias", "model.layers.0.mlp.router.bias"} <= trained


def test_wrappers_that_drop_the_router_bias_part_from_the_stock_model(tmp_path, monkeypatch, one_thread):
    """Planted: the router's logits without its bias (the wrappers' reading before GPT-OSS; the checkpoint's biases
    are drawn). C2 names the MLP; with the bias kept, C2 passes."""
    from tic.gates import get
    from tic.skill.runner import run_gate

    ctx = small_ladder_ctx(tmp_path, monkeypatch, gpt_oss_config(), "float32")
    try:
        blocks = moe_blocks(ctx.train_engine().model)
        assert run_gate(get("C2"), ctx).verdict == "pass"
        for block in blocks:
            block._tic_logit_bias = None
        assert_c2_parts_at(ctx, ".mlp")
    finally:
        hf._MODELS.clear()


def test_packed_rows_across_sequences_fail_c6(tmp_path, monkeypatch, one_thread):
    """Planted: tic's mask function does not see the model's position ids, and GPT-OSS builds its masks without
    them, so a packed row attends across its sequences. C6's packed layout then differs."""
    from tic.gates import get
    from tic.skill.runner import run_gate

    monkeypatch.setattr(modules, "_record_positions", lambda module, args, kwargs: setattr(
        module, "_tic_positions_token", modules._MODEL_POSITIONS.set(None)))
    ctx = small_ladder_ctx(tmp_path, monkeypatch, gpt_oss_config(), "float32")
    try:
        res = run_gate(get("C6"), ctx)
        assert res.verdict == "fail" and "packing=True" in res.reason, res.reason
    finally:
        hf._MODELS.clear()
