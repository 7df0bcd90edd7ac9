"""Seeded random tiny causal LMs of several families, for generative tests of the locator (no downloads).

A draw picks a family and its sizes from the seed, writes config.json, and builds the weights through
tic.harness.model.generate (cached by content hash under TIC_CACHE).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tic.harness.model.generate import cache_root, generate_model

FAMILIES = ("qwen3", "qwen3_moe", "llama", "mistral", "mixtral", "gemma3_text")
_ARCH = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "llama": "LlamaForCausalLM",
         "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


def random_config(family: str, rng: random.Random) -> dict:
    """A small config of `family` with sizes drawn from rng (float32, CPU-sized)."""
    heads = rng.choice([2, 4])
    kv = rng.choice([h for h in (1, 2, 4) if heads % h == 0])
    head_dim = rng.choice([8, 16])
    cfg = {
        "architectures": [_ARCH[family]], "model_type": family, "vocab_size": rng.choice([128, 256, 384]),
        "hidden_size": rng.choice([32, 48, 64]), "intermediate_size": rng.choice([64, 96, 128]),
        "num_hidden_layers": rng.choice([2, 3, 4]), "num_attention_heads": heads, "num_key_value_heads": kv,
        "head_dim": head_dim, "hidden_act": "silu", "max_position_embeddings": 256,
        "rms_norm_eps": rng.choice([1e-6, 1e-5]), "rope_theta": rng.choice([10000.0, 500000.0]),
        "attention_bias": False, "tie_word_embeddings": False, "initializer_range": 0.02, "dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2,
    }
    if family == "qwen3_moe":
        cfg.update(num_experts=rng.choice([4, 8]), num_experts_per_tok=2, moe_intermediate_size=rng.choice([16, 32]),
                   norm_topk_prob=True, decoder_sparse_step=1,
                   mlp_only_layers=rng.choice([[], [0]]))
    if family == "mixtral":
        cfg.update(num_local_experts=rng.choice([4, 8]), num_experts_per_tok=2)
    if family == "mistral":
        cfg["sliding_window"] = None
    if family == "gemma3_text":  # per-head q/k norms on [B, H, T, D], GELU, sliding-window layers
        cfg.update(sliding_window=rng.choice([4, 8]), sliding_window_pattern=rng.choice([2, 3]),
                   query_pre_attn_scalar=head_dim, hidden_activation="gelu_pytorch_tanh", pad_token_id=0)
    return cfg


def tiny_model(seed: int, family: str | None = None) -> tuple[Path, dict]:
    """(model directory, config) of the model drawn from `seed` (family drawn too unless given)."""
    rng = random.Random(seed)
    family = family or FAMILIES[seed % len(FAMILIES)]
    cfg = random_config(family, rng)
    config_dir = cache_root() / "tinymodels" / f"{family}-{seed}"
    config_dir.mkdir(parents=True, exist_ok=True)
    path = config_dir / "config.json"
    text = json.dumps(cfg, indent=1, sort_keys=True)
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return generate_model(config_dir, seed), cfg
