"""The bundled Megatron-core patches: metadata, listing next to the vLLM ones, and (with megatron-core installed)
the MoE combine in float32 top-k slot order on the real moe_utils.unpermute."""

import sys

import pytest
import torch

from tic import patches
from tic.core.errors import TicInputError

NAME = "megatron-moe-slot-order-combine"


def test_listed_with_metadata_and_guide():
    from pathlib import Path

    p = patches.registry()[NAME]
    assert (p.target, p.module, p.engine) == ("megatron-core", "megatron.core", "megatron")
    guide = Path(patches.__file__).resolve().parent.parent / p.guide
    assert guide.is_file() and NAME in guide.read_text()


def test_config_takes_it_on_the_megatron_train_side_only():
    from tic.config.schema import EngineConfig

    assert EngineConfig(engine="megatron", patches=[NAME]).patches == [NAME]
    with pytest.raises(ValueError, match="not engine 'vllm'"):
        EngineConfig(engine="vllm", patches=[NAME])


def _routing(tokens=64, experts=8, k=4, hidden=16, dtype=torch.bfloat16, seed=0):
    """Top-k routing with the probabilities in the model dtype (Megatron's router output without moe_router_dtype)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g)
    top, ids = torch.topk(torch.softmax(logits, -1), k)
    probs = torch.zeros(tokens, experts, dtype=dtype).scatter(1, ids, top.to(dtype))
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, ids, True)
    x = (torch.randn(tokens, hidden, generator=g) * 4).to(dtype)
    return x, probs, routing_map, ids


def _slot_order_reference(expert_out, probs, ids):
    """Per token: the k slots in torch.topk's order, each times its weight in float32, summed from +0."""
    acc = torch.zeros(expert_out.shape[0], expert_out.shape[-1])
    for s in range(ids.shape[1]):
        e = ids[:, s]
        acc += expert_out[torch.arange(len(e)), e].float() * probs[torch.arange(len(e)), e].float()[:, None]
    return acc


def test_combine_is_float32_slot_order_and_reverts():
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.moe import moe_utils

    x, probs, routing_map, ids = _routing()
    permuted, _, sorted_indices = moe_utils.permute(x, routing_map)
    # a distinct output per (token, expert): each expert scales its rows differently
    experts_of_rows = routing_map.T.nonzero()[:, 0]
    out_rows = (permuted.float() * (1 + experts_of_rows[:, None] / 7)).to(x.dtype)
    expert_out = torch.zeros(x.shape[0], routing_map.shape[1], x.shape[1], dtype=x.dtype)
    expert_out[sorted_indices, experts_of_rows] = out_rows
    want = _slot_order_reference(expert_out, probs, ids).to(x.dtype)

    stock = moe_utils.unpermute(out_rows, sorted_indices, x.shape, probs=probs, routing_map=routing_map)
    try:
        patches.apply([NAME])
        assert patches.active() == [NAME]
        from megatron.core.transformer.moe import token_dispatcher

        assert token_dispatcher.unpermute is moe_utils.unpermute  # rebound where the dispatchers imported it
        got = moe_utils.unpermute(out_rows, sorted_indices, x.shape, probs=probs, routing_map=routing_map)
        assert got.dtype == x.dtype and torch.equal(got, want)
        with pytest.raises(RuntimeError, match="fused and drop-and-pad"):
            moe_utils.unpermute(out_rows, sorted_indices, x.shape, probs=probs, routing_map=routing_map, fused=True)
    finally:
        patches.apply([])
    assert NAME not in patches.active()
    assert torch.equal(moe_utils.unpermute(out_rows, sorted_indices, x.shape, probs=probs, routing_map=routing_map),
                       stock)
    assert not torch.equal(stock, want)  # the control: Megatron's own combine rounds otherwise on this input


def test_outside_version_range_is_refused(monkeypatch):
    p = patches.registry()[NAME]
    monkeypatch.setattr(type(p), "installed_version", lambda self: "0.15.3")
    with pytest.raises(TicInputError, match="outside >=0.16.0,<0.17"):
        p.check_target()
