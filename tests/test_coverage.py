"""Declared kernel coverage (harness/kernels/coverage.py), the families it adds (Gemma-2/3, sliding windows) on
the consistent CPU kernels, and the fidelity check that refuses a wrapper computing another model (C2)."""

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tic.config.schema import load_config
from tic.gates import get
from tic.harness.engines import hf
from tic.harness.kernels.routing import Routing
from tic.harness.kernels.spec import RolloutKernels
from tic.harness.kernels.coverage import REGISTRY, coverage_problems, coverage_table, read_coverage
from tic.harness.kernels.norms import norm_eps
from tic.harness.model.layer_structure import build_meta
from tic.skill.context import GateContext
from tic.skill.runner import run_gate

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

FAMILIES = ("tiny-gemma3", "tiny-gemma2", "tiny-mistral-sliding", "tiny-olmoe", "tiny-olmo2", "tiny-phi3",
            "tiny-granite", "tiny-qwen2-moe", "tiny-stablelm", "tiny-starcoder2", "tiny-phi2", "tiny-gpt-neox",
            "tiny-glm", "tiny-cohere", "tiny-helium", "tiny-smollm3", "tiny-exaone4", "tiny-olmo3", "tiny-glm4",
            "tiny-vaultgemma", "tiny-nemotron", "tiny-hunyuan", "tiny-granitemoe", "tiny-hunyuan-moe")


def meta_of(name: str, **changes) -> nn.Module:
    cfg = json.loads((EXAMPLES / name / "config.json").read_text())
    return build_meta({**cfg, **changes})


@pytest.mark.parametrize("name, layer0, model_level", [
    ("tiny-qwen3", {"decoder:two_norm", "norm:rms", "attention:full", "attention:qk_norm", "mlp:silu_and_mul"},
     {"embedding", "rope:one_table", "norm:rms"}),
    ("tiny-gemma3", {"decoder:four_norm", "norm:rms_1p", "attention:sliding", "attention:qk_norm",
                     "mlp:gelu_tanh_and_mul"}, {"embedding:scaled", "embedding:tied", "rope:per_layer_type"}),
    ("tiny-gemma2", {"decoder:four_norm", "norm:rms_1p", "attention:sliding", "attention:softcap",
                     "mlp:gelu_tanh_and_mul"}, {"embedding:scaled", "logits:softcap", "rope:one_table"}),
    ("tiny-mistral-sliding", {"decoder:two_norm", "norm:rms", "attention:sliding", "mlp:silu_and_mul"},
     {"embedding", "rope:one_table"}),
    ("tiny-olmoe", {"decoder:two_norm", "norm:rms", "attention:full", "attention:qk_norm_projection",
                    "moe:topk_silu"}, {"embedding", "rope:one_table"}),
    ("tiny-olmo2", {"decoder:post_norm", "norm:rms", "attention:full", "attention:qk_norm_projection",
                    "mlp:silu_and_mul"}, {"embedding", "rope:one_table"}),
    ("tiny-phi3", {"decoder:two_norm", "norm:rms", "attention:full", "mlp:silu_and_mul"},  # fused qkv, gate_up
     {"embedding", "rope:one_table"}),
    ("tiny-granite", {"decoder:scaled_residual", "norm:rms", "attention:full", "mlp:silu_and_mul"},
     {"embedding", "embedding:tied", "rope:one_table", "logits:scaled"}),
    ("tiny-qwen2-moe", {"decoder:two_norm", "norm:rms", "attention:full", "mlp:silu_and_mul"},  # layer 0: dense
     {"embedding", "rope:one_table"}),
    ("tiny-stablelm", {"decoder:two_norm", "norm:layer", "attention:full", "mlp:silu_and_mul"},
     {"embedding", "rope:one_table", "norm:layer"}),
    ("tiny-starcoder2", {"decoder:two_norm", "norm:layer", "attention:full", "mlp:plain"},
     {"embedding", "embedding:tied", "rope:one_table", "norm:layer"}),
    ("tiny-phi2", {"decoder:parallel", "norm:layer", "attention:full", "mlp:plain", "mlp:plain_vllm_kernel"},
     {"embedding", "rope:one_table", "norm:layer"}),
    ("tiny-gpt-neox", {"decoder:parallel_two_norm", "norm:layer", "attention:full", "attention:qkv_fused",
                       "mlp:plain"}, {"embedding", "rope:one_table", "norm:layer"}),
    ("tiny-glm", {"decoder:two_norm", "norm:rms", "attention:full", "mlp:silu_and_mul"},  # fused gate_up
     {"embedding", "rope:one_table", "rope:interleaved", "norm:rms"}),
    ("tiny-cohere", {"decoder:parallel_residual_first", "norm:layer_float32", "attention:full", "mlp:silu_and_mul"},
     {"embedding", "embedding:tied", "rope:one_table", "rope:interleaved", "norm:layer_float32"}),
    ("tiny-helium", {"decoder:two_norm", "norm:rms", "attention:full", "mlp:silu_and_mul"},
     {"embedding", "rope:one_table", "rope:interleaved", "norm:rms"}),
    ("tiny-nemotron", {"decoder:two_norm", "norm:layer_1p", "attention:full", "mlp:plain"},
     {"embedding", "rope:one_table", "norm:layer_1p"}),
    ("tiny-hunyuan", {"decoder:two_norm", "norm:rms", "attention:full", "attention:qk_norm",
                      "attention:qk_norm_after_rotary", "mlp:silu_and_mul"}, {"embedding", "rope:one_table"}),
    ("tiny-granitemoe", {"decoder:scaled_residual", "norm:rms", "attention:full", "moe:topk_silu"},
     {"embedding", "logits:scaled", "rope:one_table"}),
    ("tiny-hunyuan-moe", {"attention:qk_norm_after_rotary", "moe:topk_silu", "moe:shared_expert"},
     {"embedding", "rope:one_table"}),
])
def test_reader_finds_each_layers_operator_classes(name, layer0, model_level):
    rows = coverage_table(meta_of(name))
    assert layer0 <= set(rows[0]["operator_classes"]) and model_level <= set(rows[-1]["operator_classes"])
    kernels = [k for k in ("consistent", "vllm") if all(k in REGISTRY[c].kernels for c in layer0)]
    assert all(r["covered_by"] == kernels and not r["refused"] for r in rows[:-1])
    assert rows[-1]["covered_by"] == ["consistent", "vllm"] and not rows[-1]["refused"]
    assert all(c in REGISTRY for r in rows for c in r["operator_classes"])


def test_a_dropout_that_drops_is_refused_one_of_probability_zero_is_the_identity():
    """Phi-3's layers hold residual dropouts: of probability 0 they are the identity the wrappers leave out; any
    other probability is refused, naming the module (the wrappers' forward runs without dropout)."""
    assert not coverage_table(meta_of("tiny-phi3"))[0]["refused"]
    refused = coverage_table(meta_of("tiny-phi3", resid_pdrop=0.1))[0]["refused"]
    assert any("resid_attn_dropout" in r and "dropout of probability 0.1" in r for r in refused), refused


@pytest.mark.parametrize("arch, model_type, extra, interleaved", [
    ("HeliumForCausalLM", "helium", {}, True),  # interleaved pairs over the whole head
    ("GlmForCausalLM", "glm", {"partial_rotary_factor": 0.5}, True),  # interleaved over 8 of 16 head features
    ("LlamaForCausalLM", "llama", {}, False),  # neox over the whole head,
    ("Phi3ForCausalLM", "phi3", {"partial_rotary_factor": 0.5}, False),  # and over its first half (rotate_neox)
])
def test_rotary_is_read_by_computation(arch, model_type, extra, interleaved):
    """C0 runs the modeling module's own apply_rotary_pos_emb on seeded rows of the table's width against the
    wrappers' two rotations: neox (halves paired) and interleaved (pairs 2i, 2i+1), whole or partial; either is
    covered, and the interleaved one is named (rope:interleaved: the attention runs that rotation)."""
    cfg = {"architectures": [arch], "model_type": model_type, "vocab_size": 64, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "max_position_embeddings": 64, "pad_token_id": 0, **extra}
    model = coverage_table(build_meta(cfg))[-1]
    assert not [r for r in model["refused"] if r.startswith("rotary")], model["refused"]
    assert ("rope:interleaved" in model["operator_classes"]) == interleaved, model["operator_classes"]


@pytest.mark.parametrize("multiplier, structure", [(0.22, "decoder:scaled_residual"), (1.0, "decoder:two_norm")])
def test_a_scaled_residual_add_is_read_as_its_own_layer_kind(multiplier, structure):
    """Granite scales each sublayer's output before the residual add: a layer kind of its own (the control: a
    multiplier of 1 is a plain two-norm layer)."""
    cfg = {"architectures": ["GraniteForCausalLM"], "model_type": "granite", "vocab_size": 64, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 64, "residual_multiplier": multiplier}
    (layer,) = [c for c in read_coverage(build_meta(cfg)) if c.layer != "model"]
    other = ({"decoder:scaled_residual", "decoder:two_norm"} - {structure}).pop()
    assert not layer.refusals and structure in layer.classes and other not in layer.classes


def test_inventory_reads_mistrals_window_on_every_layer():
    from tic.harness.model.families import layer_kinds

    cfg = json.loads((EXAMPLES / "tiny-mistral-sliding" / "config.json").read_text())
    assert {k["attention"] for k in layer_kinds(cfg)} == {"sliding"}
    assert {k["attention"] for k in layer_kinds({**cfg, "sliding_window": None})} == {"full"}


def test_inventory_reads_olmoes_layers_as_moe_from_config_alone():
    from tic.harness.model.families import layer_kinds

    cfg = json.loads((EXAMPLES / "tiny-olmoe" / "config.json").read_text())
    assert {k["mlp"] for k in layer_kinds(cfg)} == {"moe"}


@pytest.mark.parametrize("model_type,config_cls,extra", [
    ("gemma2", "Gemma2Config", {}), ("gemma3_text", "Gemma3TextConfig", {}),
    ("gemma3_text", "Gemma3TextConfig", {"sliding_window_pattern": 3})])
def test_inventory_reads_gemmas_layer_types_as_transformers_derives_them(model_type, config_cls, extra):
    """Released Gemma configs carry no layer_types: C0's manifest (raw config.json) must read the same layers as
    transformers' config, which derives them from the period."""
    import transformers

    from tic.harness.model.families import layer_kinds

    cfg = {"model_type": model_type, "num_hidden_layers": 8, **extra}
    want = getattr(transformers, config_cls)(num_hidden_layers=8, **extra).layer_types
    assert [k["attention"] for k in layer_kinds(cfg)] == [t.split("_")[0] for t in want]


def test_full_and_sliding_layers_of_one_model_read_apart():
    rows = coverage_table(meta_of("tiny-gemma3"))
    assert "attention:full" in rows[2]["operator_classes"] and "attention:sliding" not in rows[2]["operator_classes"]
    rows = coverage_table(meta_of("tiny-qwen3", use_sliding_window=True, sliding_window=4, max_window_layers=2))
    assert [("attention:sliding" in r["operator_classes"]) for r in rows[:4]] == [False, False, True, True]


class OffsetRMSNorm(nn.Module):
    """A norm neither variant computes: w * x_hat + 0.1."""

    def __init__(self, d):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), 1e-6

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) + 0.1


def test_a_norm_computing_another_function_is_refused_with_its_module():
    model = meta_of("tiny-qwen3")
    model.model.layers[1].post_attention_layernorm = OffsetRMSNorm(64)
    problems = coverage_problems(model)
    assert problems == ["model.layers.1.post_attention_layernorm (OffsetRMSNorm): a norm computing neither "
                        "w * x_hat nor (1 + w) * x_hat (RMSNorm), torch's LayerNorm (with w or w + 1) nor a LayerNorm written out "
                        "in float32, the norms the wrappers implement"]


def test_an_unknown_layer_structure_is_refused():
    model = meta_of("tiny-qwen3")
    for layer in model.model.layers:
        layer.pre_feedforward_layernorm = copy.deepcopy(layer.input_layernorm)  # three norms: neither structure
    problems = coverage_problems(model)
    assert len(problems) == 1 and problems[0].startswith("model.layers.{0,1,2,3} (Qwen3DecoderLayer): a decoder "
                                                         "layer of children")


def test_one_unknown_layer_among_known_ones_is_refused():
    """A layer the reader recognises as no kind at all (here a block without attention or mixer) must not be
    skipped because the other layers are known: left unwrapped it would run stock kernels on both sides."""

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(64, 64)

    model = meta_of("tiny-qwen3")
    model.model.layers[2] = Odd()
    problems = coverage_problems(model)
    assert problems == ["model.layers.2 (Odd): a layer structure the wrappers do not know (children: proj)"]
    table = {r["layer"]: r for r in coverage_table(model)}
    assert table["model.layers.2"]["covered_by"] == [] and table["model.layers.1"]["covered_by"]


@pytest.mark.parametrize("model_type, layer_class", [("gpt2", "GPT2Block"), ("gptj", "GPTJBlock")])
def test_an_unknown_layer_list_under_another_name_is_refused_by_its_own_path(model_type, layer_class):
    """Layers held in transformer.h (GPT-2, GPT-J): the refusal names that list's entries and their class, found
    by the config's layer count, not a generic 'model.layers'."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                               n_embd=32, n_layer=3, n_head=4, bos_token_id=1, eos_token_id=2).to_dict()
    problems = coverage_problems(build_meta(cfg))
    assert problems[0].startswith(f"transformer.h.{{0,1,2}} ({layer_class}): a layer structure the wrappers do not "
                                  "know (children: "), problems


def test_q_and_k_norms_read_per_head_or_over_the_whole_projection():
    """A q/k norm over head_dim features is per head (Qwen3), one over its projection's width is whole-projection
    (OLMoE); the reader tells them apart by width alone, so one table holds both."""
    head = coverage_table(meta_of("tiny-qwen3"))[0]["operator_classes"]
    whole = coverage_table(meta_of("tiny-olmoe"))[0]["operator_classes"]
    assert "attention:qk_norm" in head and "attention:qk_norm_projection" not in head
    assert "attention:qk_norm_projection" in whole and "attention:qk_norm" not in whole


def test_a_post_norm_layer_is_refused_on_vllm_kernels():
    """vLLM 0.26 runs OLMo-2 through its Transformers backend (HF's rotary in torch), which the vLLM provider
    does not mirror: kernels: vllm refuses the layer kind in one line."""
    assert coverage_problems(meta_of("tiny-olmo2"), "vllm") == [
        "model.layers.{0,1,2,3} (Olmo2DecoderLayer): decoder:post_norm is not implemented by kernels: vllm"]


def test_clip_qkv_runs_on_consistent_kernels_and_is_refused_on_vllm(example, workdir, one_thread):
    """transformers' OLMoE clamps q, k and v to +-clip_qkv; vLLM 0.26's does not, so kernels: vllm refuses it
    naming the field, while the consistent wrappers clamp as transformers does: C2's fidelity check and C5 pass
    with a clip that bites, and fidelity fails when the wrappers' clamp is dropped."""
    assert coverage_problems(meta_of("tiny-olmoe", clip_qkv=0.05), "vllm") == [
        "model.layers.{0,1,2,3} (OlmoeDecoderLayer): attention:clip_qkv is not implemented by kernels: vllm "
        "(config clip_qkv=0.05)"]
    ex = example("tiny-olmoe")
    cfg = json.loads((ex / "config.json").read_text())
    (ex / "config.json").write_text(json.dumps({**cfg, "clip_qkv": 0.05}))  # below the seeded q/k/v's range
    ctx = small_ctx(lambda _: ex, "tiny-olmoe")
    assert run_gate(get("C2"), ctx).verdict == "pass" and run_gate(get("C5"), ctx).verdict == "pass"
    for m in ctx.train_engine().model.modules():
        if hasattr(m, "_tic_clip"):
            m._tic_clip = None
    res = run_gate(get("C2"), ctx)
    assert res.verdict == "fail" and res.details["fidelity"]["first_parting_module"] == \
        "model.layers.0.self_attn.o_proj"
    hf._MODELS.clear()


def test_an_activation_outside_the_registry_names_the_config_field():
    problems = coverage_problems(meta_of("tiny-qwen3", hidden_act="gelu"))
    assert problems == ["model.layers.{0,1,2,3}.mlp (Qwen3MLP): a gated MLP whose activation is neither SiLU nor "
                        "GELU-tanh (config hidden_act='gelu')"]


def test_a_class_one_provider_lacks_is_named_with_the_field(monkeypatch):
    """Coverage is per provider: a class only the CPU kernels implement refuses kernels: vllm, naming the layer,
    its class, the operator and the config field and value."""
    import dataclasses

    from tic.harness.kernels import coverage

    monkeypatch.setitem(coverage.REGISTRY, "attention:softcap", dataclasses.replace(
        REGISTRY["attention:softcap"], kernels=frozenset({"consistent"})))
    model = meta_of("tiny-gemma2")
    assert coverage_problems(model, "consistent") == []
    assert coverage_problems(model, "vllm") == [
        "model.layers.{0,1,2,3} (Gemma2DecoderLayer): attention:softcap is not implemented by kernels: vllm "
        "(config attn_logit_softcapping=50.0)"]
    assert all(r.covered_by() == ["consistent"] for r in read_coverage(model)[:-1])


def test_c0_prints_the_table_and_fails_an_uncovered_layer(example, workdir, tic):
    ex = example("tiny-gemma3")
    code, out, err = tic("gate", "C0", "-c", str(ex / "tic.yaml"), "--json")
    rec = json.loads(out)["results"][0]
    assert code == 0 and rec["verdict"] == "pass"
    assert len(rec["details"]["kernel_coverage"]) == 5
    assert "C0 kernel coverage: model.layers.0 (Gemma3DecoderLayer): " in err and "-> consistent, vllm" in err
    cfg = json.loads((ex / "config.json").read_text())
    (ex / "config.json").write_text(json.dumps({**cfg, "hidden_activation": "relu"}))
    code, out, err = tic("gate", "C0", "-c", str(ex / "tic.yaml"), "--json")
    rec = json.loads(out)["results"][0]
    assert code == 1 and rec["verdict"] == "fail"
    assert ("kernels: consistent does not cover model.layers.{0,1,2,3}.mlp (Gemma3MLP): a gated MLP whose "
            "activation is neither SiLU nor GELU-tanh (config hidden_activation='relu')") in rec["reason"]
    assert "NOT COVERED" in err


# ---- the new families on the consistent CPU kernels: C3-C7 --------------------------------------------------
def small_ctx(example, name: str, dtype: str | None = None) -> GateContext:
    hf._MODELS.clear()
    cfg = load_config(example(name) / "tic.yaml")
    cfg.model.dtype = dtype or cfg.model.dtype
    cfg.prompts.count, cfg.prompts.max_len, cfg.sampling.max_tokens = 3, 12, 6
    cfg.layouts.batch_sizes, cfg.layouts.probes = [3], 1
    cfg.locate.enabled = False
    return GateContext(cfg)


@pytest.mark.parametrize("name", FAMILIES)
def test_family_passes_c3_to_c7_on_consistent_kernels(example, workdir, one_thread, name):
    ctx = small_ctx(example, name)
    for gate in ("C3", "C4", "C5", "C6", "C7"):
        res = run_gate(get(gate), ctx)
        assert res.verdict == "pass", (name, gate, res.reason)
    hf._MODELS.clear()


# ---- fidelity (C2): the wrapped model computes the stock one ------------------------------------------------
@pytest.mark.parametrize("name", FAMILIES)
def test_fidelity_passes_the_wrappers(example, workdir, name):
    ctx = small_ctx(example, name)
    res = run_gate(get("C2"), ctx)
    fid = res.details["fidelity"]
    assert res.verdict == "pass", res.reason
    assert fid["first_parting"] is None and fid["modules_checked"] > 20 and fid["logits_max_abs"] < 1e-4
    hf._MODELS.clear()


def test_qk_norms_are_placed_beside_the_rotary_by_the_attentions_own_forward(example, workdir):
    """Qwen3 norms q and k before the rotary, HunYuan after it (read on the meta device too). A generated model's
    norm weights are all ones, under which a per-head norm commutes with the rotary: C2 passes the read placement
    and refuses a wrapper that norms before the rotary in layer 0's attention, on its second pass with the
    constant weights made uneven."""
    from tic.harness.kernels.coverage import qk_norm_after_rotary

    assert "attention:qk_norm_after_rotary" not in coverage_table(meta_of("tiny-qwen3"))[0]["operator_classes"]
    assert qk_norm_after_rotary(meta_of("tiny-qwen3").model.layers[0].self_attn, "q_norm") is False
    assert qk_norm_after_rotary(meta_of("tiny-hunyuan").model.layers[0].self_attn, "query_layernorm") is True
    # Qwen3-Next's q projection carries an output gate beside the queries: its norm's input is not the projection's
    # output, and still comes before the rotary
    nxt = build_meta({**json.loads((EXAMPLES / "tiny-qwen3" / "config.json").read_text()), "model_type": "qwen3_next",
                      "architectures": ["Qwen3NextForCausalLM"], "layer_types": ["full_attention"] * 4,
                      "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32})
    assert qk_norm_after_rotary(nxt.model.layers[0].self_attn, "q_norm") is False
    ctx = small_ctx(example, "tiny-hunyuan")
    model = ctx.train_engine().model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    res = run_gate(get("C2"), ctx)
    assert res.verdict == "pass", res.reason  # the control: the wrappers' placement, read from the forward
    uneven = res.details["fidelity"]["uneven_constants"]
    assert uneven["parameters"] > 0 and uneven["first_parting"] is None
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # the weights put back
    for m in model.modules():
        if getattr(m, "_tic_qk_after_rope", False):
            m._tic_qk_after_rope = False
    res = run_gate(get("C2"), ctx)
    assert res.verdict == "fail" and res.details["fidelity"]["first_parting_module"].startswith(
        "model.layers.0.self_attn"), res.details["fidelity"]
    assert "made uneven" in res.reason
    hf._MODELS.clear()


def test_an_ungated_shared_expert_is_added_and_routed_scaling_is_refused(example, workdir):
    """HunYuan's shared_mlp joins the routed experts' output as it is: a wrapper that drops it agrees with itself
    bitwise, and C2 refuses it at the MoE block. A block whose routed output is scaled (DeepSeek-style
    routed_scaling_factor) is refused at C0."""
    ctx = small_ctx(example, "tiny-hunyuan-moe")
    for m in ctx.train_engine().model.modules():
        if getattr(m, "_tic_shared", None):
            m._tic_shared = None
    res = run_gate(get("C2"), ctx)
    assert res.verdict == "fail" and res.details["fidelity"]["first_parting_module"] == "model.layers.0.mlp", \
        res.details["fidelity"]
    hf._MODELS.clear()
    meta = meta_of("tiny-hunyuan-moe")
    meta.model.layers[0].mlp.routed_scaling_factor = 2.5
    assert any("routed_scaling_factor" in p for p in coverage_problems(meta))


def test_fidelity_fails_a_layer_norm_wrapper_without_the_plus_one(example, workdir):
    """Nemotron's LayerNorm1P wrapped as a plain LayerNorm agrees with itself bitwise; C2 refuses it at the first
    norm."""
    ctx = small_ctx(example, "tiny-nemotron")
    for m in ctx.train_engine().model.modules():
        if getattr(m, "_tic_weight_plus_one", False):
            m._tic_weight_plus_one = False
    res = run_gate(get("C2"), ctx)
    assert res.verdict == "fail" and res.details["fidelity"]["first_parting_module"] == \
        "model.layers.0.input_layernorm"
    hf._MODELS.clear()


def test_fidelity_fails_a_wrapper_computing_w_instead_of_1_plus_w(example, workdir):
    """The planted wrapper agrees with itself bitwise (C3-C6 would pass); C2 refuses it at the first norm."""
    ctx = small_ctx(example, "tiny-gemma3")
    for m in ctx.train_engine().model.modules():
        if hasattr(m, "_tic_norm_offset"):
            m._tic_norm_offset = 0.0  # Llama's w * x_hat on Gemma's zero-centred weights
    res = run_gate(get("C2"), ctx)
    assert res.verdict == "fail" and res.details["fidelity"]["first_parting_module"] == \
        "model.layers.0.input_layernorm"
    assert res.reason.startswith("fidelity: kernels: consistent computes another model than stock HF from "
                                 "model.layers.0.input_layernorm (Gemma3RMSNorm)")
    assert run_gate(get("C3"), ctx).verdict == "pass"  # the plant is invisible to the consistency gates
    hf._MODELS.clear()


def _norm_each_head(self, x):
    """A planted q/k norm: each head normalised alone (the projection's weight split by head), where the model
    normalises the whole projection. Deterministic, so both sides agree with it bitwise."""
    d = self._plant_head_dim
    heads = x.reshape(*x.shape[:-1], -1, d)
    out = self._tic_ops.rms_norm(heads, torch.ones(d, dtype=x.dtype), norm_eps(self))
    return out.reshape(x.shape) * self.weight


def _plant_norm_each_head(model):
    import types

    for m in model.modules():
        for norm in (getattr(m, "q_norm", None), getattr(m, "k_norm", None)):
            if norm is not None:
                norm._plant_head_dim = m.head_dim
                norm.forward = types.MethodType(_norm_each_head, norm)


def _norm_the_sum(self, hidden_states, **kwargs):
    """A planted post-norm layer in the pre-norm order: norm(x + attn(x)) where OLMo-2 adds x + norm(attn(x))."""
    h = self.self_attn(hidden_states=hidden_states, **kwargs)[0]
    h = self.post_attention_layernorm(hidden_states + h)
    return self.post_feedforward_layernorm(h + self.mlp(h))


def _plant_norm_the_sum(model):
    import types

    for m in model.model.layers:
        m.forward = types.MethodType(_norm_the_sum, m)


@pytest.mark.parametrize("name, plant, parting", [
    ("tiny-olmoe", _plant_norm_each_head, "model.layers.0.self_attn.q_norm"),
    ("tiny-olmo2", _plant_norm_the_sum, "model.layers.0.post_attention_layernorm")])
def test_fidelity_fails_a_wrapper_computing_another_olmo(example, workdir, name, plant, parting):
    """OLMoE/OLMo-2 wrappers that normalise each head where the model normalises the whole projection, or norm
    the residual sum where OLMo-2 norms the sublayer's output: each agrees with itself bitwise (C3 passes it);
    C2's fidelity check refuses it at the first module that parts."""
    ctx = small_ctx(example, name)
    plant(ctx.train_engine().model)
    res = run_gate(get("C2"), ctx)
    assert res.verdict == "fail" and res.details["fidelity"]["first_parting_module"] == parting, res.reason
    assert run_gate(get("C3"), ctx).verdict == "pass"
    hf._MODELS.clear()


def _sharp_bf16_llama_ctx(tmp_path, monkeypatch):
    """A bf16 Llama drawn wide (init 0.5, 4 layers, no q/k norm): its attention is sharp enough that a rounding step
    in one layer moves the next layers' outputs by more than C2's 5 % bf16 bound, the stock model's own included."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
    from tic_small_ladder import small_ladder_ctx, wide_llama_config

    return small_ladder_ctx(tmp_path, monkeypatch, wide_llama_config(0.5, 4), "bfloat16")


def _plant_plus_one_norm(model):
    model.model.layers[2].post_attention_layernorm._tic_norm_offset = 1.0  # (1 + w) where Llama has w


def _plant_attention_scale(model):
    attn = model.model.layers[2].self_attn
    attn.scaling = attn.scaling * 2


@pytest.mark.parametrize("plant, parting", [
    (None, None),
    (_plant_plus_one_norm, "model.layers.2.post_attention_layernorm"),
    (_plant_attention_scale, "model.layers.2.self_attn")])
def test_fidelity_checks_a_sharp_bf16_model_layer_by_layer(tmp_path, monkeypatch, plant, parting):
    """Control: the whole forward parts beyond the bound on rounding alone; layer by layer (each layer on the stock
    model's input to it, bounds at least twice the float32 stock model's distance there) it does not, and C2
    passes. Planted wrong wrappers in layer 2 still part, named at their module."""
    ctx = _sharp_bf16_llama_ctx(tmp_path, monkeypatch)
    try:
        if plant is not None:
            plant(ctx.train_engine().model)
        res = run_gate(get("C2"), ctx)
        fid = res.details["fidelity"]
        if plant is None:
            assert res.verdict == "pass" and fid["layer_local"]["layers"] == 4, res.reason
        else:
            assert res.verdict == "fail" and fid["first_parting_module"].startswith(parting), res.reason
            assert "each decoder layer on the stock model's input to it" in fid["first_parting"]
    finally:
        hf._MODELS.clear()


def test_fidelity_pins_stock_moe_routes_at_near_ties_only(example, workdir):
    """In bf16 the tiny OLMoE's router meets exact and near ties (two experts' probabilities within a rounding
    step), where stock HF and the wrappers may pick either: the stock routers take the wrapped model's experts
    there, and C2 passes. A router that picks other experts outright is not a tie: it still fails."""
    ctx = small_ctx(example, "tiny-olmoe", "bfloat16")
    res = run_gate(get("C2"), ctx)
    assert res.verdict == "pass" and res.details["fidelity"]["routing_flips"] > 0, res.reason
    prov = ctx.train_engine().model._tic_ops.provider
    route = prov.moe_route
    prov.moe_route = lambda logits, top_k, routing, bias=None: route(-logits, top_k, routing, bias)  # the least likely
    res = run_gate(get("C2"), ctx)
    assert res.verdict == "fail" and res.details["fidelity"]["first_parting_module"] == "model.layers.0.mlp"
    hf._MODELS.clear()


# ---- kernels: vllm plumbing for the new classes, on CPU with stand-ins for vLLM's kernels --------------------
def _cpu_vllm_provider(monkeypatch):
    from tic.harness.kernels.vllm_provider import VLLMProvider

    monkeypatch.setattr(VLLMProvider, "_load_vllm", lambda self: None)
    prov = VLLMProvider(RolloutKernels(4))
    prov.fa_version = 3
    return prov


def test_vllm_provider_passes_the_window_and_softcap_to_flash_attention(monkeypatch):
    """A sliding, softcapped layer: the provider hands FlashAttention window_size (window - 1, 0) and softcap
    over the layout of the windowed mask; a stand-in kernel honouring both gives the CPU kernel's values."""
    from tic.harness.kernels import autograd as ag
    from tic.harness.kernels.consistent_cpu import CPUProvider
    from tic.harness.kernels.vllm_provider import VLLMProvider

    calls = []

    def varlen(q, k, v, cu_seqlens_q, seqused_k, softmax_scale, block_table, window_size=(-1, -1), softcap=0.0,
               **kw):
        calls.append((window_size, softcap))
        outs, cu = [], cu_seqlens_q.tolist()
        for s, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
            ks, vs = (torch.cat([c[blk] for blk in block_table[s].tolist()])[:int(seqused_k[s])] for c in (k, v))
            outs.append(ag.attention_ref(q[a:b].transpose(0, 1)[None], ks.transpose(0, 1)[None],
                                         vs.transpose(0, 1)[None], None, softmax_scale, softcap or None,
                                         window_size[0] + 1 if window_size[0] >= 0 else None)[0])
        return torch.cat(outs).to(q.dtype)

    monkeypatch.setattr(VLLMProvider, "_find_varlen_attention", staticmethod(lambda: varlen))
    prov = _cpu_vllm_provider(monkeypatch)
    ar = torch.arange(9)
    causal = ar[None, :] <= ar[:, None]
    left = causal & (ar[None, :] >= 2) & (ar[:, None] >= 2)
    mask = torch.stack([causal, left])[:, None] & (ar[:, None] - ar[None, :] < 3)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 9, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    got = prov.attention(q, k, v, mask, 0.35, softcap=5.0, window=3)
    want = CPUProvider().attention(q, k, v, mask, 0.35, softcap=5.0, window=3)
    valid = mask[:, 0].diagonal(dim1=1, dim2=2)
    assert calls == [((2, 0), 5.0)] and torch.allclose(got[valid], want[valid], rtol=1e-5, atol=1e-6)
    with pytest.raises(Exception, match="sliding window of 4"):
        prov.attention(q, k, v, mask, 0.35, window=4)  # a mask of another window is refused, never run


def test_vllm_provider_gemma_norm_runs_vllms_ir_norm_on_vllms_layout(monkeypatch):
    """The (1 + w) norm goes to vLLM's IR ops rms_norm / fused_add_rms_norm (stand-in: their native arithmetic)
    with the float32 weight 1 + w, as GemmaRMSNorm.forward_native passes it, on the rows vLLM's Gemma layers pass
    ([tokens, hidden]; [tokens, heads, head_dim] for q/k); the add+norm returns the sum."""
    import types

    from tic.harness.kernels.consistent_cpu import CPUProvider

    prov = _cpu_vllm_provider(monkeypatch)
    calls = []

    def native(x, weight, eps, residual=None):
        calls.append((tuple(x.shape), weight.dtype))
        xf = x.float() if residual is None else x.float() + residual.float()
        out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(weight.dtype) * weight
        return out.to(x.dtype) if residual is None else (out.to(x.dtype), xf.to(x.dtype))

    ops = types.SimpleNamespace(rms_norm=native, fused_add_rms_norm=lambda x, r, w, e: native(x, w, e, r))
    ir = types.ModuleType("vllm.ir")
    ir.ops = ops
    vllm = types.ModuleType("vllm")
    vllm.ir = ir
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.ir", ir)
    g = torch.Generator().manual_seed(1)
    x, r, w = torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 16, generator=g), torch.randn(16, generator=g)
    heads = torch.randn(2, 5, 4, 16, generator=g)
    cpu = CPUProvider()
    assert torch.equal(prov.rms_norm(x, w, 1e-6, offset=1.0), cpu.rms_norm(x, w, 1e-6, offset=1.0))
    assert torch.equal(prov.rms_norm(heads, w, 1e-6, offset=1.0), cpu.rms_norm(heads, w, 1e-6, offset=1.0))
    got, total = prov.add_rms_norm(x, r, w, 1e-6, offset=1.0)
    want, want_total = cpu.add_rms_norm(x, r, w, 1e-6, offset=1.0)
    assert torch.equal(got, want) and torch.equal(total, want_total)
    assert calls == [((10, 16), torch.float32), ((10, 4, 16), torch.float32), ((10, 16), torch.float32)]


def test_vllm_provider_norms_the_whole_projection_on_the_view_vllm_passes(monkeypatch):
    """vLLM's OlmoeAttention hands _C.rms_norm q and k as [tokens, heads * head_dim] views of the fused qkv output
    (row stride q + 2 kv widths). On fused projections the wrapper passes vLLM's rms_norm entry the same view, and
    the wrapped model still computes the stock one (stand-ins: vLLM's norm entry, tic's CPU kernels elsewhere)."""
    import types

    import transformers

    from tic.harness.kernels.consistent_cpu import CPUProvider
    from tic.harness.kernels.modules import apply

    prov, cpu, seen = _cpu_vllm_provider(monkeypatch), CPUProvider(), []

    def vllm_rms_norm(out, x, w, eps):
        seen.append((tuple(x.shape), x.stride()))
        out.copy_(cpu.rms_norm(x, w, eps))

    prov.vops, prov.batch_invariant = types.SimpleNamespace(rms_norm=vllm_rms_norm), False

    class FusedProjections(CPUProvider):
        fuse_projections = True

        def rms_norm(self, x, w, eps, offset: float = 0.0):
            return prov.rms_norm(x, w, eps, offset)

    cfg = json.loads((EXAMPLES / "tiny-olmoe" / "config.json").read_text())
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg)).eval()
    ids = torch.randint(3, cfg["vocab_size"], (2, 5))
    with torch.no_grad():
        want = model(ids).logits
        got = apply(model, FusedProjections())(ids).logits
    q, kv = cfg["hidden_size"], cfg["num_key_value_heads"] * cfg["hidden_size"] // cfg["num_attention_heads"]
    assert ((10, q), (q + 2 * kv, 1)) in seen and ((10, kv), (q + 2 * kv, 1)) in seen
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("plant", ["residual", "logits"])
def test_fidelity_fails_a_granite_wrapper_that_drops_a_multiplier(example, workdir, plant):
    """The wrapped Granite with its residual multiplier (or its logits scale) planted to 1 agrees with itself
    bitwise; C2 refuses it: at the first layer, or at the logits."""
    ctx = small_ctx(example, "tiny-granite")
    model = ctx.train_engine().model
    if plant == "residual":
        model.model.layers[0].residual_multiplier = 1.0
    else:
        model.get_output_embeddings()._tic_logit_scale = 1.0
    res = run_gate(get("C2"), ctx)
    first = res.details["fidelity"]["first_parting_module"]
    assert res.verdict == "fail", res.reason
    assert first.startswith("model.layers.0.") if plant == "residual" else first == "logits", first
    hf._MODELS.clear()


def test_qwen2_moe_shared_expert_is_read_and_a_wrapper_dropping_its_gate_fails_c2(example, workdir):
    """The MoE layers read as top-k experts plus a sigmoid-gated shared expert; a wrapped block that adds the
    shared expert ungated agrees with itself bitwise, and C2 refuses it at that block."""
    cov = {c.layer: c for c in read_coverage(meta_of("tiny-qwen2-moe"))}
    assert {"moe:topk_silu", "moe:shared_expert", "mlp:silu_and_mul"} <= set(cov["model.layers.1"].classes)
    assert not cov["model.layers.1"].refusals
    ctx = small_ctx(example, "tiny-qwen2-moe")
    ctx.train_engine().model.model.layers[1].mlp.shared_expert_gate = None
    res = run_gate(get("C2"), ctx)
    assert res.verdict == "fail", res.reason
    assert res.details["fidelity"]["first_parting_module"] == "model.layers.1.mlp", res.details["fidelity"]
    hf._MODELS.clear()


def test_stablelm_layernorm_plant_fails_c2_and_its_unsupported_variants_are_refused(example, workdir):
    """A wrapper that runs an RMSNorm where the model has a LayerNorm agrees with itself bitwise; C2 refuses it at
    that norm. StableLM's parallel residual (one norm per layer) reads as a parallel layer summed residual first
    (transformers' residual + attention + MLP); its per-head q/k LayerNorms (one LayerNorm for each head) are
    covered by the consistent kernels and refused for kernels: vllm, naming the class."""
    ctx = small_ctx(example, "tiny-stablelm")
    norm = ctx.train_engine().model.model.layers[0].input_layernorm
    norm.forward = lambda x, residual=None: norm._tic_ops.rms_norm(x, norm.weight, norm.eps)
    res = run_gate(get("C2"), ctx)
    assert res.verdict == "fail", res.reason
    assert res.details["fidelity"]["first_parting_module"] == "model.layers.0.input_layernorm"
    hf._MODELS.clear()
    parallel = read_coverage(meta_of("tiny-stablelm", use_parallel_residual=True))[0]
    assert "decoder:parallel_residual_first" in parallel.classes and not parallel.refusals  # one norm
    meta = meta_of("tiny-stablelm", qk_layernorm=True)
    assert coverage_problems(meta, "consistent") == []
    assert any("attention:qk_norm_each_head is not implemented by kernels: vllm" in p
               for p in coverage_problems(meta, "vllm"))


def test_stablelms_layernorm_for_each_head_climbs_and_a_shared_one_parts(tmp_path, monkeypatch, one_thread):
    """StableLM's qk_layernorm: a LayerNorm of its own for each q and k head (read from its forward), run head by
    head on the wrappers' rows; the model climbs C0-C7. Planted: every head through head 0's norm agrees with
    itself bitwise, and C2 names the attention once the norms' generated ones are made uneven."""
    from transformers import CONFIG_MAPPING

    sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
    from tic_small_ladder import assert_climbs, small_ladder_ctx

    config = CONFIG_MAPPING["stablelm"](vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, qk_layernorm=True,
                                        max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    ctx = small_ladder_ctx(tmp_path, monkeypatch, config, "float32")
    assert_climbs(ctx)
    attn = ctx.train_engine().model.model.layers[1].self_attn
    norms = next(iter(attn.q_layernorm.children()))
    attn.q_layernorm.forward = lambda x: torch.stack([norms[0](x[..., h, :].contiguous())
                                                      for h in range(x.shape[-2])], dim=-2)
    try:
        res = run_gate(get("C2"), ctx)
        assert res.verdict == "fail", res.reason
        assert res.details["fidelity"]["first_parting_module"].startswith("model.layers.1.self_attn"), res.reason
    finally:
        hf._MODELS.clear()


def test_an_ungated_mlp_with_the_wrong_activation_fails_c2_and_gelu_new_is_refused(example, workdir):
    """StarCoder2's ungated MLP wrapped with ReLU instead of its tanh GELU agrees with itself bitwise; C2 refuses
    it at that MLP. gelu_new (transformers' own tanh formula, not torch's) is refused at C0 with the
    field that selects it; relu is covered."""
    ctx = small_ctx(example, "tiny-starcoder2")
    mlp = ctx.train_engine().model.model.layers[0].mlp
    mlp._tic_plain = (*mlp._tic_plain[:2], "relu")
    res = run_gate(get("C2"), ctx)
    assert res.verdict == "fail", res.reason
    assert res.details["fidelity"]["first_parting_module"].startswith("model.layers.0.mlp")
    hf._MODELS.clear()
    assert coverage_problems(meta_of("tiny-starcoder2", hidden_act="gelu_new"), "consistent") == []
    refused = coverage_problems(meta_of("tiny-starcoder2", hidden_act="gelu_new"), "vllm")
    assert refused and all("mlp:plain_vllm_kernel" in r for r in refused), refused
    assert coverage_problems(meta_of("tiny-starcoder2", hidden_act="relu"), "vllm") == []


def test_a_relu_squared_ungated_mlp_is_covered_with_its_derivative():
    """relu2 (Arcee, Nemotron): covered on both providers, since vLLM's _C.relu_squared gives torch's
    relu().square() bits; the surrogate backward is its derivative, 2 relu(x)."""
    from tic.harness.kernels.autograd import PLAIN_ACTS, _activation_input_grad

    for kernels in ("consistent", "vllm"):
        assert coverage_problems(meta_of("tiny-starcoder2", hidden_act="relu2"), kernels) == []
    row = coverage_table(meta_of("tiny-starcoder2", hidden_act="relu2"))[0]
    assert "mlp:plain" in row["operator_classes"] and "mlp:plain_vllm_kernel" not in row["operator_classes"]
    x = torch.linspace(-3, 3, 61, dtype=torch.float64, requires_grad=True)
    g = torch.randn(61, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    (want,) = torch.autograd.grad(PLAIN_ACTS["relu2"](x), x, g)
    assert torch.allclose(_activation_input_grad(x.detach(), g, "relu2").double(), want)
    y = torch.randn(256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    # one rounding of the exact float square, as the CUDA kernel: the bf16 op equals the float32 square rounded
    assert torch.equal(PLAIN_ACTS["relu2"](y), torch.relu(y.float()).square().to(torch.bfloat16))


def test_phi_parallel_layer_run_in_sequence_fails_c2(example, workdir):
    """Phi's attention and MLP read one norm's output side by side; a wrapper that feeds the MLP the post-attention
    sum instead agrees with itself bitwise, and C2 refuses it inside layer 0."""
    import types

    ctx = small_ctx(example, "tiny-phi2")
    layer = ctx.train_engine().model.model.layers[0]

    def in_sequence(self, hidden_states, **kw):
        kw.pop("past_key_values", None)
        h = hidden_states + self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kw)[0]
        return h + self.mlp(self.input_layernorm(h))

    layer.forward = types.MethodType(in_sequence, layer)
    res = run_gate(get("C2"), ctx)
    assert res.verdict == "fail", res.reason
    assert res.details["fidelity"]["first_parting_module"].startswith("model.layers.0"), res.details["fidelity"]
    hf._MODELS.clear()


def test_gpt_neox_qkv_split_as_one_block_fails_c2(example, workdir):
    """GPT-NeoX's query_key_value is laid out per head; a wrapper that splits it as [q | k | v] blocks (Phi-3's
    layout) agrees with itself bitwise, and C2 refuses it at layer 0's attention."""
    ctx = small_ctx(example, "tiny-gpt-neox")
    attn = ctx.train_engine().model.gpt_neox.layers[0].attention
    qkv = attn.query_key_value
    attn.qkv_proj, attn.config.num_key_value_heads = qkv, attn.config.num_attention_heads
    del attn._modules["query_key_value"]
    res = run_gate(get("C2"), ctx)
    assert res.verdict == "fail", res.reason
    assert res.details["fidelity"]["first_parting_module"].startswith("gpt_neox.layers.0"), res.details["fidelity"]
    hf._MODELS.clear()


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-gpt-neox"])
def test_wrapping_leaves_the_models_modules_and_state_dict_keys_as_they_were(example, name):
    """The wrappers keep what they need as plain attributes: no module is registered a second time (a state dict
    with its weights twice would be saved, synced and restored twice)."""
    ctx = small_ctx(example, name)
    stock = hf.load_model(ctx.model.dir, "float32", kernels="stock", shared=False)
    wrapped = hf.load_model(ctx.model.dir, "float32", kernels="consistent", shared=False)
    assert list(wrapped.state_dict()) == list(stock.state_dict())
    assert [n for n, _ in wrapped.named_modules(remove_duplicate=False)] == \
        [n for n, _ in stock.named_modules(remove_duplicate=False)]
    hf._MODELS.clear()


def test_glm_interleaved_rotary_is_read_and_a_neox_rotation_in_its_place_fails_c2(example, workdir):
    """GLM turns feature pairs (2i, 2i+1): read by computation as rope:interleaved, run by the rotary_interleaved op.
    A wrapper that turns the two halves instead (neox) agrees with itself bitwise; C2 refuses it in layer 0's
    attention. The modeling module's rotation turned the other way (sin negated) reads as interleaved and reversed; a
    rotary that is neither (here: cos and sin swapped) is refused."""
    import sys

    ctx = small_ctx(example, "tiny-glm")
    model = ctx.train_engine().model
    rope = model.model.layers[0].self_attn._tic_rope
    assert rope.op == "rotary_interleaved"
    rope.op = "rotary"
    res = run_gate(get("C2"), ctx)
    assert res.verdict == "fail", res.reason
    assert res.details["fidelity"]["first_parting_module"].startswith("model.layers.0.self_attn"), res.details
    hf._MODELS.clear()
    meta = meta_of("tiny-glm")
    modeling = sys.modules[type(meta.model.layers[0].self_attn).__module__]
    own = modeling.apply_rotary_pos_emb
    try:
        modeling.apply_rotary_pos_emb = lambda q, k, cos, sin, *a, **kw: own(q, k, cos, -sin, *a, **kw)
        turned_back = coverage_table(meta)[-1]
        modeling.apply_rotary_pos_emb = lambda q, k, cos, sin, *a, **kw: own(q, k, sin, cos, *a, **kw)
        refused = coverage_table(meta)[-1]["refused"]
    finally:
        modeling.apply_rotary_pos_emb = own
    assert {"rope:interleaved", "rope:reversed"} <= set(turned_back["operator_classes"]), turned_back
    assert any("neither" in r or "otherwise than neox or interleaved" in r for r in refused), refused


def test_a_parallel_layers_sum_order_is_read_by_computation():
    """Phi adds (attention + MLP) + residual, Cohere residual + attention + MLP; in floating point these differ,
    and vLLM sums each model as transformers does, so the wrapper must too. Read from the layer's own forward."""
    from tic.harness.kernels.coverage import parallel_sum_order

    assert parallel_sum_order(meta_of("tiny-phi2").model.layers[0]) == "sublayers_first"
    assert parallel_sum_order(meta_of("tiny-cohere").model.layers[0]) == "residual_first"
    model = meta_of("tiny-cohere")
    layer = model.model.layers[0]

    def residual_mlp_attention(self, hidden_states, **kwargs):  # (r + m) + a: an order the wrappers do not run
        h = self.input_layernorm(hidden_states)
        return hidden_states + self.mlp(h) + self.self_attn(hidden_states=h)[0]

    own = type(layer).forward  # the probe runs the class's forward
    type(layer).forward = residual_mlp_attention
    try:
        assert parallel_sum_order(layer) == "other"
        refused = coverage_table(model)[0]["refused"]
    finally:
        type(layer).forward = own
    assert any("in another order" in r for r in refused), refused


def test_cohere_norm_and_rotary_layout_plants_fail_c2_and_per_head_norms_are_refused(example, workdir,
                                                                                      monkeypatch):
    """CohereLayerNorm (LayerNorm written out in float32, no bias) run as an RMSNorm, and the rotary table read as
    halves where the Cohere module lays each angle out twice: each wrapper agrees with itself bitwise, and C2
    refuses it. Per-head q/k CohereLayerNorms (use_qk_norm) are refused at C0."""
    from tic.harness.kernels import rope

    ctx = small_ctx(example, "tiny-cohere")
    norm = ctx.train_engine().model.model.layers[0].input_layernorm
    norm.forward = lambda x, residual=None: norm._tic_ops.rms_norm(x, norm.weight, 1e-5)
    res = run_gate(get("C2"), ctx)
    assert res.verdict == "fail", res.reason
    assert res.details["fidelity"]["first_parting_module"] == "model.layers.0.input_layernorm"
    hf._MODELS.clear()
    from tic.harness.kernels.consistent_cpu import CPUProvider

    def halves(self, rotary, config, n, dtype, device, layer_type=None):
        cos, sin = rope._rotary_output(rotary, n, device, layer_type)
        half = cos.shape[-1] // 2
        return torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1).to(dtype)

    monkeypatch.setattr(CPUProvider, "cos_sin_cache", halves)
    ctx = GateContext(ctx.cfg)  # a fresh training model, its table read as halves
    res = run_gate(get("C2"), ctx)
    assert res.verdict == "fail", res.reason
    assert res.details["fidelity"]["first_parting_module"].startswith("model.layers.0.self_attn"), res.details
    hf._MODELS.clear()
    refused = coverage_table(meta_of("tiny-cohere", use_qk_norm=True))[0]["refused"]
    assert any("q_norm" in r and "CohereLayerNorm" in r for r in refused), refused


# ---- layers without position embeddings (NoPE) and layer types an attention names its own way ------------------
class _Rotating(nn.Module):
    def __init__(self, apply: bool, fail: bool = False):
        super().__init__()
        self.q_proj, self.apply, self.fail = nn.Linear(8, 8), apply, fail

    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        q = self.q_proj(hidden_states)
        if self.fail:
            raise RuntimeError("a forward this probe cannot drive")
        if self.apply:
            cos, sin = position_embeddings
            q = q * cos.repeat(1, 1, 2)[..., :8] + q * sin.repeat(1, 1, 2)[..., :8]
        return q, None


def test_whether_an_attention_reads_its_position_embeddings_is_read_by_computation():
    """The probe runs the attention's own forward: an operator on cos or sin means rotary; a forward that ends
    without one is a NoPE layer; a forward that cannot run is unknown (the wrappers then apply rotary)."""
    from tic.harness.kernels.coverage import applies_rotary

    assert applies_rotary(_with_head(_Rotating(True))) is True
    assert applies_rotary(_with_head(_Rotating(False))) is False
    assert applies_rotary(_with_head(_Rotating(False, fail=True))) is None
    meta = _with_head(_Rotating(False)).to("meta")  # C0 reads a model built on the meta device
    assert applies_rotary(meta) is False


def _with_head(m):
    m.head_dim = 4
    return m


@pytest.mark.parametrize("name, nope", [("tiny-smollm3", {3}), ("tiny-exaone4", {3}), ("tiny-olmo3", set()),
                                        ("tiny-qwen3", set())])
def test_nope_layers_and_full_layers_of_a_sliding_model_are_read_per_layer(name, nope):
    """SmolLM3's no_rope_layers and EXAONE-4's full layers take (cos, sin) and never read them: attention:no_rope
    on those layers alone; EXAONE-4 keeps the config's window on every attention but slides only on its sliding
    layers, and OLMo-3's attention names its layer type attention_type."""
    from tic.harness.kernels.coverage import attention_layer_type, attention_window, is_attention

    model = meta_of(name)
    cov = [c for c in read_coverage(model) if c.layer != "model"]
    assert {i for i, c in enumerate(cov) if "attention:no_rope" in c.classes} == nope
    cfg = model.config.get_text_config()
    for i, layer in enumerate(model.model.layers):
        attn = next(m for m in layer.modules() if is_attention(m))
        kind = attention_layer_type(attn, cfg)
        assert (attention_window(attn, cfg) is None) == (kind in (None, "full_attention")), (name, i, kind)


def test_a_wrapper_rotating_a_nope_layer_fails_c2(example, workdir, monkeypatch):
    """The plant: the wrappers apply the rotary table on SmolLM3's NoPE layer too; C2's fidelity check parts at
    that layer's attention."""
    from tic.harness.kernels import coverage

    monkeypatch.setattr(coverage, "is_no_rope", lambda m: False)
    res = run_gate(get("C2"), small_ctx(example, "tiny-smollm3"))
    assert res.verdict == "fail" and res.details["fidelity"]["first_parting_module"].startswith(
        "model.layers.3.self_attn"), res.reason
    hf._MODELS.clear()


@pytest.mark.parametrize("model_type, field, module", [
    ("doge", "input_residual", "DogeDecoderLayer"),             # learned residual scales on the layer itself
    ("diffllama", "lambda_q1", "DiffLlamaAttention"),           # a differential attention's lambdas
])
def test_parameters_the_wrappers_do_not_use_are_refused_at_c0(model_type, field, module):
    """A layer or attention holding parameters of its own computes with weights the wrappers' forward never reads:
    refused with the module and the parameters (C0 passed these before and C2 or C7 failed them later)."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, intermediate_size=64).to_dict()
    problems = coverage_problems(build_meta(cfg))
    line = next((p for p in problems if "parameters of its own" in p), None)
    assert line is not None and module in line and field in line, problems


@pytest.mark.parametrize("layout", ["per_head", "multi_query", "grouped"])
def test_a_fused_qkv_layout_is_read_from_the_attentions_own_forward(layout):
    """The split of one fused query_key_value into q, k and v, read by computation from transformers' Falcon
    attention in its three layouts (per head, q-then-k-then-v with one key/value head, per key/value group), on
    the meta device as C0 builds it: each index is the feature the model's own forward takes."""
    from transformers import FalconConfig
    from transformers.models.falcon.modeling_falcon import FalconAttention

    from tic.harness.kernels.coverage import fused_qkv_layout

    H, D, KV = 4, 8, 2
    cfg = FalconConfig(hidden_size=H * D, num_attention_heads=H, num_kv_heads=KV, multi_query=layout == "multi_query",
                       new_decoder_architecture=layout == "grouped", alibi=False, bias=False)
    cfg._attn_implementation = "eager"
    with torch.device("meta"):
        attn = FalconAttention(cfg, layer_idx=0)
    q, k, v = fused_qkv_layout(attn)
    heads = torch.arange(H)[:, None] * D + torch.arange(D)
    if layout == "per_head":  # [q_h | k_h | v_h] per head
        per_head = torch.arange(H)[:, None] * 3 * D + torch.arange(D)
        want = tuple((per_head + off).flatten() for off in (0, D, 2 * D))
    elif layout == "multi_query":  # [q of all heads | k | v]
        want = (heads.flatten(), H * D + torch.arange(D), H * D + D + torch.arange(D))
    else:  # per key/value group: [its queries | k | v]
        per = H // KV + 2
        g = torch.arange(KV)[:, None] * per * D
        qs = (g[:, None] + (torch.arange(H // KV)[:, None] * D + torch.arange(D))[None]).flatten()
        want = (qs, (g + (per - 2) * D + torch.arange(D)).flatten(), (g + (per - 1) * D + torch.arange(D)).flatten())
    assert all(torch.equal(got, w) for got, w in zip((q, k, v), want)), (q, k, v)
    assert cfg._attn_implementation == "eager"  # the probe leaves the config as it found it


@pytest.mark.parametrize("name, structure, roles", [
    ("tiny-glm4", "decoder:four_norm", {"input_layernorm": "input_layernorm",
                                        "post_attention_layernorm": "post_self_attn_layernorm",
                                        "pre_feedforward_layernorm": "post_attention_layernorm",
                                        "post_feedforward_layernorm": "post_mlp_layernorm"}),
    ("tiny-vaultgemma", "decoder:two_norm", {"input_layernorm": "input_layernorm",
                                             "post_attention_layernorm": "pre_feedforward_layernorm"}),
    ("tiny-qwen3", "decoder:two_norm", {"input_layernorm": "input_layernorm",
                                        "post_attention_layernorm": "post_attention_layernorm"}),
    ("tiny-olmo2", "decoder:post_norm", {"post_attention_layernorm": "post_attention_layernorm",
                                         "post_feedforward_layernorm": "post_feedforward_layernorm"}),
])
def test_a_layers_norms_are_read_by_what_each_is_handed_whatever_their_names(name, structure, roles):
    """The dataflow probe runs the layer's own forward with stand-ins: GLM-4's post_attention_layernorm is the norm
    before its MLP (Gemma's pre_feedforward place), VaultGemma's pre_feedforward_layernorm is a Llama layer's
    second norm; a layer with a norm that its forward never calls matches no structure."""
    from tic.harness.kernels.coverage import norm_roles

    layer = meta_of(name).model.layers[0]
    assert norm_roles(layer) == (structure, roles)
    extra = copy.copy(layer)
    some_norm = getattr(layer, next(iter(roles.values())))
    extra._modules = dict(extra._modules, spare_layernorm=copy.deepcopy(some_norm))
    assert norm_roles(extra) is None


def test_glm4_norms_wrapped_in_each_others_places_fail_c2(example, workdir, monkeypatch):
    """The plant: the wrappers run GLM-4's pre-MLP norm where its post-attention norm belongs and back; both sides
    agree with themselves, and C2's fidelity check parts at layer 0."""
    from tic.harness.kernels import coverage

    real = coverage.norm_roles

    def swapped(layer):
        structure, roles = real(layer)
        roles["post_attention_layernorm"], roles["pre_feedforward_layernorm"] = \
            roles["pre_feedforward_layernorm"], roles["post_attention_layernorm"]
        return structure, roles

    monkeypatch.setattr(coverage, "norm_roles", swapped)
    res = run_gate(get("C2"), small_ctx(example, "tiny-glm4"))
    assert res.verdict == "fail" and res.details["fidelity"]["first_parting_module"].startswith("model.layers.0"), \
        res.reason
    hf._MODELS.clear()


def test_routers_are_read_from_their_own_forward():
    """A MoE block's router is read by what it computes, on the meta device too: Qwen3-MoE's renormalises its top-k
    softmax weights, Jamba's keeps them, and PhiMoE's sparsemixer (weights of its own at other experts) is no
    softmax top-k, so C0 names its MoE blocks as not covered."""
    from transformers import AutoModelForCausalLM, JambaConfig, PhimoeConfig, Qwen3MoeConfig

    from tic.harness.kernels.coverage import moe_router, router_renormalizes

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    with torch.device("meta"):
        qwen = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**small, num_experts=4, num_experts_per_tok=2,
                                                               moe_intermediate_size=16, norm_topk_prob=True))
        jamba = AutoModelForCausalLM.from_config(JambaConfig(**small, num_experts=4, num_experts_per_tok=2,
                                                             expert_layer_period=1, expert_layer_offset=0))
        phi = AutoModelForCausalLM.from_config(PhimoeConfig(**small, num_local_experts=4, num_experts_per_tok=2))
    assert router_renormalizes(moe_router(qwen.model.layers[0].mlp)) is True
    assert router_renormalizes(moe_router(jamba.model.layers[0].feed_forward)) is False
    assert router_renormalizes(moe_router(phi.model.layers[0].mlp)) is None
    assert any("PhimoeSparseMoeBlock" in p and "router" in p for p in coverage_problems(phi))
    assert not any("Qwen3MoeSparseMoeBlock" in p for p in coverage_problems(qwen))


def test_a_router_whose_selection_bias_starts_at_zero_is_not_read_as_a_softmax_top_k():
    """Ernie-4.5-MoE picks its experts by softmax + a correction bias that a generated model holds at zero, where
    the selection equals the softmax's; a trained checkpoint's bias moves it. The router is read with every
    parameter seeded, so it is refused on a real (not meta) model too, and a Qwen3-MoE router still reads."""
    from transformers import AutoModelForCausalLM, Ernie4_5_MoeConfig, Qwen3MoeConfig

    from tic.harness.kernels.coverage import moe_router, router_renormalizes

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    ernie = AutoModelForCausalLM.from_config(Ernie4_5_MoeConfig(**small, moe_num_experts=4, moe_k=2,
                                                                moe_intermediate_size=16, moe_layer_start_index=0))
    qwen = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**small, num_experts=4, num_experts_per_tok=2,
                                                           moe_intermediate_size=16, norm_topk_prob=True))
    router = moe_router(ernie.model.layers[0].mlp)
    bias = router.moe_statics.e_score_correction_bias
    assert not bias.any()  # as generated
    before = {k: v.clone() for k, v in router.state_dict().items()}
    assert router_renormalizes(router) is None
    assert all(torch.equal(v, router.state_dict()[k]) for k, v in before.items())  # read on a copy
    assert router_renormalizes(moe_router(qwen.model.layers[0].mlp)) is True


def test_c2_fidelity_keeps_a_routers_own_weights_where_it_chose_the_same_experts(tmp_path, workdir, monkeypatch):
    """C2's routing pin gives the stock router the wrapped model's experts only where they differ by a near tie;
    where they are the experts it chose itself it keeps its own weights. So a router of another rule than the
    wrappers' softmax top-k parts at its block even past C0 (PhiMoE's sparsemixer, with C0's refusal of it
    bypassed: before, the pin rewrote its weights as a softmax top-k and C2 passed)."""
    from transformers import PhimoeConfig

    from tic.harness.kernels import coverage, modules
    from tic.skill.context import GateContext

    cfg = PhimoeConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                       bos_token_id=1, eos_token_id=2).to_dict()
    cfg.update(architectures=["PhimoeForCausalLM"], dtype="float32")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "tic.yaml").write_text(
        "model: {path: ., dtype: float32, generate: {seed: 0}}\n"
        "rollout: {engine: hf, kernels: consistent}\ntrain: {engine: hf, kernels: consistent}\n")
    for where in (coverage, modules):  # C0's refusal and the wrappers: a renormalised softmax top-k
        monkeypatch.setattr(where, "router_routing", lambda router, cfg=None, handed=None: Routing())
    hf._MODELS.clear()
    res = run_gate(get("C2"), GateContext(load_config(tmp_path / "tic.yaml")))
    assert res.verdict == "fail" and res.details["fidelity"]["first_parting_module"].endswith(".mlp"), res.reason
    hf._MODELS.clear()


def test_an_attention_that_takes_alibi_biases_is_refused_for_them():
    """Bloom's attention always takes ALiBi biases (an `alibi` argument; its config has no flag): C0 says so, not
    that the fused qkv's layout could not be read (the layout probe cannot drive an ALiBi forward)."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("bloom", vocab_size=64, hidden_size=32, n_layer=2, n_head=4).to_dict()
    problems = coverage_problems(build_meta(cfg))
    assert any("self_attention (BloomAttention): ALiBi position biases" in p for p in problems), problems
    assert not any("query_key_value" in p for p in problems), problems
