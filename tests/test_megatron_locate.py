"""The locator on the Megatron train engine: a divergence planted inside the Megatron side only fails C5, and the
locator names the first divergent layer, module and operator under the checkpoint's (HF) module names, with a repro
that exits 1 in a fresh process; with nothing planted, the same search over the same two sides finds nothing (the
sequence-first layout and the renamed, fused modules are no difference of their own)."""

import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.core")

from tic.config.schema import EngineConfig, load_config  # noqa: E402
from tic.gates import get  # noqa: E402
from tic.gates.base import Measurement  # noqa: E402
from tic.harness.engines import hf  # noqa: E402
from tic.harness.engines.megatron import load_megatron_model  # noqa: E402
from tic.harness.locate.search import locate, sides_for_gate  # noqa: E402
from tic.harness.model.megatron_convert import conversion_plan, module_map  # noqa: E402
from tic.harness.testing.tinymodels import tiny_model  # noqa: E402
from tic.skill.context import GateContext  # noqa: E402
from tic.skill.runner import run_gate  # noqa: E402


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe"])
def test_module_names_come_from_the_converters_plan(family):
    from safetensors.torch import load_file

    model_dir, cfg = tiny_model(3, family)
    names = list(load_file(str(model_dir / "model.safetensors")))
    got = module_map(conversion_plan(names, cfg))
    assert got["model.layers.1"] == "decoder.layers.1"
    assert got["model.layers.1.self_attn"] == "decoder.layers.1.self_attention"
    assert got["model.layers.1.post_attention_layernorm"] == "decoder.layers.1.pre_mlp_layernorm"
    assert got["model.layers.1.mlp"] == "decoder.layers.1.mlp"
    assert got["model.embed_tokens"] == "embedding.word_embeddings" and got["model.norm"] == "decoder.final_layernorm"
    # q/k/v (and gate/up) land in one fused Megatron tensor: none of them is that module
    assert not {"model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj"} & set(got)
    assert "model" not in got and len(set(got.values())) == len(got)
    if family == "qwen3_moe":
        assert got["model.layers.1.mlp.gate"] == "decoder.layers.1.mlp.router"


def test_a_one_layer_model_keeps_the_layer_name():
    """model.layers and model.layers.0 hold the same tensors: the deeper name is the layer's."""
    names = ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
             "model.layers.0.post_attention_layernorm.weight", "model.norm.weight"]
    got = module_map(conversion_plan(names, {"model_type": "llama"}))
    assert got["model.layers.0"] == "decoder.layers.0" and "model.layers" not in got


def _eps(gpt):
    gpt.decoder.layers[1].pre_mlp_layernorm.eps = 1e-3


def _bf16_activation(gpt):
    """Layer 1's SiLU*mul rounded through bfloat16 (the Megatron MLP's own activation, no other layer's)."""
    mlp = gpt.decoder.layers[1].mlp
    ops, fwd = mlp.shared.ops, mlp.forward
    real = ops.silu_and_mul

    def planted(hidden_states, **kw):
        ops.silu_and_mul = lambda x: real(x).to(torch.bfloat16).to(x.dtype)
        try:
            return fwd(hidden_states, **kw)
        finally:
            del ops.silu_and_mul

    mlp.forward = planted


@pytest.fixture
def megatron_ctx(example, workdir):
    def make(name):
        hf._MODELS.clear()
        cfg = load_config(example(name) / "tic-consistent.yaml")
        cfg.prompts.count, cfg.sampling.max_tokens = 4, 6
        cfg.train = EngineConfig.model_validate({**cfg.train.model_dump(), "engine": "megatron"})
        return GateContext(cfg)
    yield make
    hf._MODELS.clear()


PLANTS = [("tiny-qwen3", _eps, "model.layers.1.post_attention_layernorm", {"aten.add.Tensor"}),
          ("tiny-qwen3", _bf16_activation, "model.layers.1.mlp", {"aten.to.dtype", "aten._to_copy.default"}),
          ("tiny-qwen3-moe", _eps, "model.layers.1.post_attention_layernorm", {"aten.add.Tensor"})]


@pytest.mark.parametrize("name,plant,module,ops", PLANTS, ids=["eps", "activation", "moe-eps"])
def test_a_c5_failure_inside_megatron_is_located_with_a_repro(megatron_ctx, name, plant, module, ops):
    ctx = megatron_ctx(name)
    plant(ctx.train_engine().model.gpt)
    res = run_gate(get("C5"), ctx)
    assert res.verdict == "fail"
    loc = res.details["locate"]
    assert loc["status"].startswith("localized"), loc["status"]
    assert loc["reproduced_gate_values"] is True
    assert loc["first_divergent_layer"] == "model.layers.1"
    assert loc["culprit_module"] == module
    assert loc["first_operator"] in ops, loc["first_operator"]
    assert loc["repro_check"]["reproduces"]
    proc = subprocess.run([sys.executable, "-I", loc["repro"]], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr


def test_nothing_planted_the_same_search_finds_no_divergence(megatron_ctx, tmp_path):
    ctx = megatron_ctx("tiny-qwen3")
    assert run_gate(get("C5"), ctx).verdict == "pass"
    side_a, side_b, upto, _ = sides_for_gate(ctx, "C5", Measurement(metrics={"first_mismatch": {
        "sequence": 1, "position": 3}}))
    found = locate(side_a, side_b, tmp_path / "out", "C5", upto)
    assert found.status == "no divergence" and found.first_divergent_layer is None
    layers = {r["stage"]: r for r in found.layers}
    # every decoder layer and the final norm were compared under the HF names, not skipped
    assert all(layers[f"model.layers.{i}"]["positions"] > 0 for i in range(4)) and layers["model.norm"]["equal"]
    assert found.repro is None


def test_a_c6_failure_between_two_megatron_sides_is_located(megatron_ctx):
    """Both sides Megatron (the reference layout planted, a variant layout not): the same names on both. The
    layouts share one model, as the hf engine's do, so the planted one is given a model of its own."""
    ctx = megatron_ctx("tiny-qwen3")
    eng = ctx.train_engine()
    eng.model = load_megatron_model(*eng._load_args, shared=False)
    _eps(eng.model.gpt)
    res = run_gate(get("C6"), ctx)
    assert res.verdict == "fail"
    loc = res.details["locate"]
    assert (loc["first_divergent_layer"], loc["culprit_module"], loc["first_operator"]) == \
        ("model.layers.1", "model.layers.1.post_attention_layernorm", "aten.add.Tensor"), loc
    assert loc["repro_check"]["reproduces"] and loc["repro_check"]["exit_code"] == 1


# ---- C2's fidelity check on the Megatron model ----------------------------------------------------------------
def test_c2_checks_the_megatron_model_against_stock_hf_module_by_module(megatron_ctx):
    res = run_gate(get("C2"), megatron_ctx("tiny-qwen3"))
    fid = res.details["fidelity"]
    assert res.verdict == "pass", res.reason
    assert fid["engine"] == "megatron" and fid["first_parting"] is None
    # decoder layers, attention, norms and MLPs under their HF names, not the logits alone
    assert fid["modules_checked"] > 20 and fid["logits_max_abs"] < 1e-4


def test_c2_fails_a_megatron_mlp_that_swaps_gate_and_up(megatron_ctx):
    """linear_fc1 read as [up; gate] (a converter or spec that swaps them would agree with itself bitwise): C2 names
    the layer's MLP, in the stock model's call order, under its HF name."""
    ctx = megatron_ctx("tiny-qwen3")
    fc1 = ctx.train_engine().model.gpt.decoder.layers[1].mlp.linear_fc1.weight
    with torch.no_grad():
        fc1.copy_(torch.cat(fc1.chunk(2)[::-1]))
    res = run_gate(get("C2"), ctx)
    assert res.verdict == "fail" and res.details["fidelity"]["first_parting_module"] == "model.layers.1.mlp"
    assert res.reason.startswith("fidelity: kernels: consistent computes another model than stock HF from "
                                 "model.layers.1.mlp (Qwen3MLP)"), res.reason
