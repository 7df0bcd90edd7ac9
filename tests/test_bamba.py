"""A Bamba-style hybrid on tic's consistent CPU kernels: Mamba-2 mixers in the attention's place of two-norm decoder
layers (input_layernorm, mamba or self_attn, pre_ff_layernorm, feed_forward), attention at the layers
attn_layer_indices names. C0 covers it, C3-C7 pass, a planted single-step decode in one mixer fails C4, and C0
refuses a configuration with no attention layer, which transformers cannot decode."""

from __future__ import annotations

import json

import pytest

from tic.config.schema import load_config
from tic.gates import get
from tic.harness.engines import hf
from tic.harness.testing.mamba_plants import plant_single_step_decode
from tic.skill.context import GateContext
from tic.skill.runner import run_gate

CONFIG = dict(model_type="bamba", architectures=["BambaForCausalLM"], vocab_size=128, hidden_size=32,
              intermediate_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
              max_position_embeddings=256, tie_word_embeddings=False, dtype="float32", rms_norm_eps=1e-6,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_layer_indices=[2], mamba_n_heads=8,
              mamba_d_head=8, mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=4)
TIC_YAML = """model: {path: ., dtype: float32, generate: {seed: 0, init_std: 0.5}}
rollout: {engine: hf, kernels: consistent, batch_size: 8}
train: {engine: hf, kernels: consistent, micro_batch_size: 4, padding_side: right}
prompts: {source: random, count: 5, seed: 0, min_len: 4, max_len: 24}
sampling: {temperature: 1.0, max_tokens: 10, seed: 0}
layouts: {batch_sizes: [3], positions: [first, last], probes: 1}
locate: {enabled: false}
state_dir: .tic-consistent
"""


def _model_dir(tmp_path, **changes):
    d = tmp_path / "bamba"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**CONFIG, **changes}))
    (d / "tic-consistent.yaml").write_text(TIC_YAML)
    return d


@pytest.fixture
def bamba_ctx(tmp_path, workdir):
    hf._MODELS.clear()
    yield GateContext(load_config(_model_dir(tmp_path) / "tic-consistent.yaml"))
    hf._MODELS.clear()


def test_bamba_layers_are_covered_and_pass_c3_to_c7(bamba_ctx):
    """Chunks of 4 tokens, prompts of 4-24: decodes cross chunk boundaries. C6's layouts: micro-batch 1, padding,
    packing, shuffled order."""
    c0 = run_gate(get("C0"), bamba_ctx)
    assert c0.verdict == "pass", c0.reason
    classes = {row["layer"]: row["operator_classes"] for row in c0.details["kernel_coverage"]}
    assert "mixer:mamba2" in classes["model.layers.0"] and "attention:full" in classes["model.layers.2"]
    results = {gate: run_gate(get(gate), bamba_ctx) for gate in ("C3", "C4", "C5", "C6", "C7")}
    failed = {gate: res.reason for gate, res in results.items() if res.verdict != "pass"}
    assert not failed, failed


def test_c4_fails_when_one_bamba_mixer_decodes_by_the_single_step_recurrence(bamba_ctx):
    model = bamba_ctx.rollout_engine().model
    plant_single_step_decode(model.model.layers[1].mamba)
    res = run_gate(get("C4"), bamba_ctx)
    assert res.verdict == "fail" and res.metrics["equal_fraction"] < 1 and res.metrics["max"] > 0, res.reason


def test_c0_refuses_bamba_layers_with_no_attention_layer(tmp_path, workdir, tic):
    """Without attention layers transformers stops building the causal mask from a cache of recurrent layers
    (C3 would end in an error): C0 refuses it with the reason, naming the Mamba-2 mixers."""
    d = _model_dir(tmp_path, attn_layer_indices=[])
    code, out, _ = tic("gate", "C0", "-c", str(d / "tic-consistent.yaml"), "--json")
    rec = json.loads(out)["results"][0]
    assert (rec["verdict"], code) == ("fail", 1), rec["reason"]
    assert "Mamba-2 mixer and no attention layer anywhere" in rec["reason"], rec["reason"]
