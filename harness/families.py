"""Model families as data: how to read each layer's operator classes from config.json.

A new family is one entry here, not a new code path. Tensor names, where weights exist, override the
config rules (a layer holding `mlp.experts.*` is MoE whatever the config says).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Family:
    # MoE rule: "none" | "all" | "sparse_step" (decoder_sparse_step + mlp_only_layers) |
    # "first_k_dense" (first_k_dense_replace + moe_layer_freq) | "pattern" (hybrid pattern letter 'E')
    moe: str = "none"
    experts_key: str = "num_experts"
    # attention kind when config has no layer_types: "full", or "qwen2_window" (use_sliding_window + max_window_layers)
    attention: str = "full"
    # hybrid pattern key (one letter per layer) and what each letter means
    pattern_key: str | None = None
    pattern_letters: dict = field(default_factory=dict)
    norm: str = "rmsnorm"
    extra_classes: tuple = ("rope",)


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(attention="qwen2_window"),
    "qwen3": Family(attention="qwen2_window"),
    "qwen2_moe": Family(moe="sparse_step", attention="qwen2_window"),
    "qwen3_moe": Family(moe="sparse_step", attention="qwen2_window"),
    "mixtral": Family(moe="all", experts_key="num_local_experts"),
    "deepseek_v3": Family(moe="first_k_dense", experts_key="n_routed_experts"),
    "nemotron_h": Family(pattern_key="hybrid_override_pattern",
                         pattern_letters={"M": ("mamba2", None), "*": ("full", None), "-": (None, "dense"),
                                          "E": (None, "moe")}),
}


def family(model_type: str) -> Family | None:
    return FAMILIES.get(model_type)


def layer_kinds(cfg: dict) -> list[dict]:
    """Per layer: {'attention': kind or None, 'mlp': 'dense' | 'moe' | None}, from config.json alone."""
    fam = family(cfg.get("model_type", "")) or Family()
    n = int(cfg.get("num_hidden_layers", 0))
    out = [{"attention": "full", "mlp": "dense"} for _ in range(n)]
    if fam.pattern_key and isinstance(cfg.get(fam.pattern_key), str):
        pat = cfg[fam.pattern_key]
        for i, ch in enumerate(pat[:n]):
            att, mlp = fam.pattern_letters.get(ch, ("unknown", None))
            out[i] = {"attention": att, "mlp": mlp}
        return out
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == n:
        for i, t in enumerate(types):
            out[i]["attention"] = {"full_attention": "full", "sliding_attention": "sliding",
                                   "linear_attention": "linear"}.get(t, t)
    elif fam.attention == "qwen2_window" and cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        start = int(cfg.get("max_window_layers", n))
        for i in range(start, n):
            out[i]["attention"] = "sliding"
    n_exp = int(cfg.get(fam.experts_key) or 0)
    for i in range(n):
        if fam.moe == "all" and n_exp:
            out[i]["mlp"] = "moe"
        elif fam.moe == "sparse_step" and n_exp:
            step = int(cfg.get("decoder_sparse_step", 1) or 1)
            dense = set(cfg.get("mlp_only_layers") or [])
            out[i]["mlp"] = "moe" if (i not in dense and (i + 1) % step == 0) else "dense"
        elif fam.moe == "first_k_dense" and n_exp:
            k = int(cfg.get("first_k_dense_replace", 0))
            freq = int(cfg.get("moe_layer_freq", 1) or 1)
            out[i]["mlp"] = "moe" if (i >= k and i % freq == 0) else "dense"
    return out
