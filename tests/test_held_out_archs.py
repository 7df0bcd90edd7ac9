"""Architectures no example names: C0's coverage reading of transformers' own model types, built small on the meta
device. Each either reads as covered or is refused in lines that name a module; none may crash the reading. The
covered ones below also climb C0-C7 in tests/test_coverage.py's families where an example holds them."""

from __future__ import annotations

import pytest
from transformers import CONFIG_MAPPING

from tic.core.errors import TicInputError
from tic.harness.kernels.coverage import coverage_problems
from tic.harness.model.layer_structure import build_meta

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_routed_experts=4, num_local_experts=4,
             n_shared_experts=1, first_k_dense_replace=1, moe_k=2, moe_num_experts=4, moe_topk=2)

# read as covered on both providers
COVERED = ("ernie4_5", "seed_oss", "cwm", "ministral", "mixtral", "arcee", "nemotron", "hunyuan_v1_dense",
           "hunyuan_v1_moe", "granitemoe")
# refused, each for something the wrappers do not compute (named in the problem lines)
REFUSED = {"ernie4_5_moe": "router", "dots1": "router", "glm4_moe": "router", "minimax_m2": "router",
           "gpt_oss": "sinks", "diffllama": "lambda_q1", "doge": "input_residual", "apertus": "XIELU",
           "bitnet": "attn_sub_norm", "nanochat": "NanoChatRMSNorm", "olmo": "OlmoLayerNorm",
           "persimmon": "q_layernorm", "jetmoe": "layer structure", "llama4_text": "qk_norm"}


def small(model_type: str):
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {model_type!r} not in this release")
    return build_meta(CONFIG_MAPPING[model_type](**SMALL).to_dict())


@pytest.mark.parametrize("model_type", COVERED)
def test_a_covered_architecture_reads_without_problems(model_type):
    model = small(model_type)
    for kernels in ("consistent", "vllm"):
        assert coverage_problems(model, kernels) == [], (model_type, kernels)


def test_a_second_mlp_beside_the_moe_is_refused_as_a_sublayer_not_read_as_a_norm():
    """Granite-MoE-Shared with a shared MLP: a child of the decoder layer beside its MoE that the layer forward
    would drop; C0 names it as such."""
    if "granitemoeshared" not in CONFIG_MAPPING:
        pytest.skip("no granitemoeshared in this transformers")
    model = build_meta(CONFIG_MAPPING["granitemoeshared"](**SMALL, shared_intermediate_size=32).to_dict())
    problems = coverage_problems(model, "consistent")
    assert any("shared_mlp" in p and "a sublayer beside the attention and the MLP" in p for p in problems), problems
    assert not any("shared_mlp" in p and "a norm computing" in p for p in problems), problems


@pytest.mark.parametrize("model_type, what", sorted(REFUSED.items()))
def test_a_refused_architecture_names_what_the_wrappers_lack(model_type, what):
    try:
        model = small(model_type)
    except TicInputError as e:  # a config this release's model class cannot build small: not a coverage question
        pytest.skip(str(e))
    problems = coverage_problems(model, "consistent")
    assert problems and any(what in p for p in problems), (model_type, problems)
