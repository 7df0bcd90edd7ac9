"""Model families as data: how to read each layer's operator classes from config.json (C0's inventory), and
which config fields are indexed by layer.

For a cut these are hints, not the truth: tic.harness.model.cut_config tries the family's rewrite first and prefers
it when transformers proves it, but the proof (each cut layer built on meta as its source layer) decides, and an
architecture with no entry here is cut all the same. Tensor names, where weights exist, override the config
rules (a layer holding `mlp.experts.*` is MoE whatever the config says).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from tic.core.errors import TicInputError

# layer-type strings used in config lists -> (attention kind, mlp kind); None leaves the default in place
LAYER_TYPE_NAMES = {"full_attention": ("full", None), "sliding_attention": ("sliding", None),
                    "chunked_attention": ("chunked", None), "linear_attention": ("linear", None),
                    "attention": ("full", None), "mamba": ("mamba2", None), "mamba2": ("mamba2", None)}


@dataclass(frozen=True)
class Family:
    # MoE rule: "none" | "all" | "sparse_step" (decoder_sparse_step + mlp_only_layers) |
    # "first_k_dense" (first_k_dense_replace + moe_layer_freq) | "pattern" (hybrid pattern letter 'E')
    moe: str = "none"
    experts_key: str = "num_experts"
    # attention kind when config has no layer_types: "full", "qwen2_window" (use_sliding_window + max_window_layers),
    # "config_window" (every layer sliding when sliding_window is set: Mistral), or "every_nth_full" (layer i, from
    # 1, is full when i is a multiple of the config's sliding_window_pattern, else sliding: transformers' Gemma rule)
    attention: str = "full"
    window_pattern: int = 0  # every_nth_full's period when the config names none
    # hybrid pattern key (one letter per layer) and what each letter means
    pattern_key: str | None = None
    pattern_letters: dict = field(default_factory=dict)
    # the per-layer type list and how its strings read (overrides LAYER_TYPE_NAMES entries)
    layer_types_key: str = "layer_types"
    layer_type_names: dict = field(default_factory=dict)
    # the model holds one block per layer: an attention/mixer block *or* an MLP block (nemotron_h)
    one_block_per_layer: bool = False
    norm: str = "rmsnorm"
    extra_classes: tuple = ("rope",)
    # tensor-name prefixes of multi-token-prediction heads (dropped by a cut)
    mtp_prefixes: tuple = ("mtp.", "model.mtp.")


_NEMOTRON_H_TYPES = {"linear_attention": ("mamba2", None), "mamba": ("mamba2", None), "full_attention": ("full", None),
                     "attention": ("full", None), "mlp": (None, "dense"), "moe": (None, "moe")}

FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(attention="config_window"),
    "qwen2": Family(attention="qwen2_window"),
    "qwen3": Family(attention="qwen2_window"),
    "qwen2_moe": Family(moe="sparse_step", attention="qwen2_window"),
    "qwen3_moe": Family(moe="sparse_step", attention="qwen2_window"),
    "qwen3_next": Family(moe="sparse_step", extra_classes=("rope", "partial_rope")),
    "mixtral": Family(moe="all", experts_key="num_local_experts"),
    "deepseek_v3": Family(moe="first_k_dense", experts_key="n_routed_experts"),
    "olmoe": Family(moe="all"),
    "olmo2": Family(),
    "gemma2": Family(norm="rmsnorm_gemma", attention="every_nth_full", window_pattern=2),
    "gemma3_text": Family(norm="rmsnorm_gemma", attention="every_nth_full", window_pattern=6),
    "nemotron_h": Family(pattern_key="hybrid_override_pattern",
                         pattern_letters={"M": ("mamba2", None), "*": ("full", None), "-": (None, "dense"),
                                          "E": (None, "moe")},
                         layer_types_key="layers_block_type", layer_type_names=_NEMOTRON_H_TYPES,
                         one_block_per_layer=True, extra_classes=()),
}

# --- config fields indexed by layer, and how a cut rewrites each (see tic.harness.model.cut) ---------------------
# "count": number of layers; "list": one entry per layer; "index_list": a list of layer indices;
# "threshold": layers below it are one kind, the rest another; "pattern": a string, one letter per layer;
# "moe_rule": first_k_dense_replace/moe_layer_freq (rewritten together); "mtp": MTP layer count (set to 0)
PER_LAYER_FIELDS: dict[str, str] = {
    "num_hidden_layers": "count",
    "layer_types": "list",
    "layers_block_type": "list",
    "no_rope_layers": "list",
    "mlp_only_layers": "index_list",
    "max_window_layers": "threshold",
    "hybrid_override_pattern": "pattern",
    "first_k_dense_replace": "moe_rule",
    "moe_layer_freq": "moe_rule",
    "num_nextn_predict_layers": "mtp",
}
# fields that name layers but are not indexed by the decoder layer (left as they are)
NOT_PER_LAYER: frozenset = frozenset({
    "layer_norm_eps", "layer_norm_epsilon", "layernorm_epsilon", "norm_epsilon", "mtp_layers_block_type",
    "mtp_hybrid_override_pattern", "num_layers_per_mtp", "use_mtp_layers", "decoder_sparse_step",
    "layerdrop", "embd_layer_norm", "residual_in_fp32",
})
# quantization_config keys that may list module names (with layer indices)
QUANT_NAME_LISTS = ("ignore", "exclude_modules", "modules_to_not_convert", "ignored_layers", "skip_modules")


def int_field(cfg: dict, key: str, default: int = 0) -> int:
    """An integer config.json field (absent or null: default); any other type is a config error, said as such."""
    v = cfg.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise TicInputError(f"config.json: {key} must be an integer, got {json.dumps(v)}")
    return v


def family(model_type: str) -> Family | None:
    return FAMILIES.get(model_type)


def num_layers(cfg: dict) -> int:
    """Layer count: num_hidden_layers, or the length of the family's per-layer type list when that is absent."""
    fam = family(cfg.get("model_type", "")) or Family()
    if cfg.get("num_hidden_layers") is not None and fam.layer_types_key not in cfg:
        return int_field(cfg, "num_hidden_layers")
    types = cfg.get(fam.layer_types_key)
    if isinstance(types, list):
        return len(types)
    if fam.pattern_key and isinstance(cfg.get(fam.pattern_key), str):
        return len(cfg[fam.pattern_key])
    return int_field(cfg, "num_hidden_layers")


def layer_kinds(cfg: dict) -> list[dict]:
    """Per layer: {'attention': kind or None, 'mlp': 'dense' | 'moe' | None}, from config.json alone."""
    fam = family(cfg.get("model_type", "")) or Family()
    n = num_layers(cfg)
    out = [{"attention": "full", "mlp": "dense"} for _ in range(n)]
    types = cfg.get(fam.layer_types_key)
    names = {**LAYER_TYPE_NAMES, **fam.layer_type_names}
    if fam.pattern_key and isinstance(cfg.get(fam.pattern_key), str) and not isinstance(types, list):
        for i, ch in enumerate(cfg[fam.pattern_key][:n]):
            att, mlp = fam.pattern_letters.get(ch, ("unknown", None))
            out[i] = {"attention": att, "mlp": mlp}
        return out
    if isinstance(types, list) and len(types) == n:
        for i, t in enumerate(types):
            att, mlp = names.get(t, (t, None))
            if fam.one_block_per_layer:
                out[i] = {"attention": att, "mlp": mlp}
            else:
                out[i]["attention"] = att
                if mlp:
                    out[i]["mlp"] = mlp
        if fam.one_block_per_layer:
            return out
    elif fam.attention == "config_window" and cfg.get("sliding_window"):
        for i in range(n):
            out[i]["attention"] = "sliding"
    elif fam.attention == "every_nth_full":
        period = int_field(cfg, "sliding_window_pattern", fam.window_pattern)
        if period < 1:
            raise TicInputError(f"config.json: sliding_window_pattern must be at least 1, got {period}")
        for i in range(n):
            out[i]["attention"] = "sliding" if (i + 1) % period else "full"
    elif fam.attention == "qwen2_window" and cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        start = int_field(cfg, "max_window_layers", n)
        for i in range(start, n):
            out[i]["attention"] = "sliding"
    n_exp = int_field(cfg, fam.experts_key)
    for i in range(n):
        if fam.moe == "all" and n_exp:
            out[i]["mlp"] = "moe"
        elif fam.moe == "sparse_step" and n_exp:
            step = int_field(cfg, "decoder_sparse_step", 1) or 1
            dense = cfg.get("mlp_only_layers") or []
            if not isinstance(dense, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in dense):
                raise TicInputError(f"config.json: mlp_only_layers must be a list of layer indices, got {json.dumps(dense)}")
            dense = set(dense)
            out[i]["mlp"] = "moe" if (i not in dense and (i + 1) % step == 0) else "dense"
        elif fam.moe == "first_k_dense" and n_exp:
            out[i]["mlp"] = "moe" if first_k_dense_is_moe(i, cfg) else "dense"
    return out


def first_k_dense_is_moe(i: int, cfg: dict) -> bool:
    k = int_field(cfg, "first_k_dense_replace")
    freq = int_field(cfg, "moe_layer_freq", 1) or 1
    return i >= k and i % freq == 0
