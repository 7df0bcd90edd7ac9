"""HF -> Megatron -> HF weight conversion: bitwise round trip on seeded tiny checkpoints (safetensors), the qkv and
fc1 layouts Megatron-core expects, and one-line refusals."""

import json

import pytest
import torch
from safetensors.torch import load_file

from tic.core.errors import TicInputError
from tic.harness.model.megatron_convert import AttentionShape, fuse_qkv, hf_to_megatron, megatron_to_hf, split_qkv
from tic.harness.testing.tinymodels import tiny_model


def _checkpoint(seed: int, family: str, tied: bool = False):
    model_dir, cfg = tiny_model(seed, family)
    sd = load_file(str(model_dir / "model.safetensors"))
    cfg = json.loads((model_dir / "config.json").read_text())
    if tied:
        cfg["tie_word_embeddings"] = True
        sd.pop("lm_head.weight")
    return sd, cfg


def _same(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if k not in a or k not in b or a[k].dtype != b[k].dtype
                  or not torch.equal(a[k], b[k]))


@pytest.mark.parametrize("family,experts", [("qwen3", "sequential"), ("llama", "sequential"),
                                            ("qwen3_moe", "sequential"), ("qwen3_moe", "grouped")])
def test_round_trip_is_bitwise(family, experts):
    sd, cfg = _checkpoint(5, family)
    mg = hf_to_megatron(sd, cfg, experts)
    assert not any(k.startswith("model.") for k in mg)
    assert _same(megatron_to_hf(mg, cfg, experts), sd) == []


def test_tied_embeddings_have_no_output_layer():
    sd, cfg = _checkpoint(6, "qwen3", tied=True)
    mg = hf_to_megatron(sd, cfg)
    assert "output_layer.weight" not in mg
    assert _same(megatron_to_hf(mg, cfg), sd) == []


def test_qkv_rows_are_grouped_per_query_group():
    shape = AttentionShape(heads=4, groups=2, head_dim=1)
    q, k, v = torch.tensor([[0.], [1.], [2.], [3.]]), torch.tensor([[10.], [11.]]), torch.tensor([[20.], [21.]])
    fused = fuse_qkv(q, k, v, shape)
    assert fused.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, shape), (q, k, v)))


def test_moe_layers_follow_the_checkpoint():
    sd, cfg = _checkpoint(7, "qwen3_moe")
    mg = hf_to_megatron(sd, cfg)
    routed = {int(k.split(".")[2]) for k in mg if k.endswith("mlp.router.weight")}
    dense = {int(k.split(".")[2]) for k in mg if k.endswith("mlp.linear_fc1.weight")}
    assert routed == {int(k.split(".")[2]) for k in sd if k.endswith("mlp.gate.weight")}
    assert routed.isdisjoint(dense) and routed | dense == set(range(cfg["num_hidden_layers"]))


def test_refusals_are_one_line():
    sd, cfg = _checkpoint(5, "qwen3")
    with pytest.raises(TicInputError, match="model_type 'gemma3_text'"):
        hf_to_megatron(sd, {**cfg, "model_type": "gemma3_text"})
    with pytest.raises(TicInputError, match="no Megatron place"):
        hf_to_megatron({**sd, "model.layers.0.extra.weight": torch.zeros(1)}, cfg)
    mg = hf_to_megatron(sd, cfg)
    with pytest.raises(TicInputError, match="no checkpoint place"):
        megatron_to_hf({**mg, "decoder.layers.0.mlp.experts.linear_fc1.weight0": torch.zeros(1)}, cfg)
