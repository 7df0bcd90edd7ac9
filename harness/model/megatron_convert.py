"""HF checkpoint weights <-> Megatron-core GPTModel weights (local layer spec names), from the same config.json.

Pure tensor layout, no Megatron import: names are renamed and two projections are fused the way Megatron-core
holds them (Megatron-Bridge's Qwen3 / Llama / Qwen3-MoE bridges use the same layouts):
- `self_attention.linear_qkv`: per query group, that group's query heads, then its key head, then its value head
  (rows [g0: q.. k v | g1: q.. k v | ...]), so a tensor-parallel split over groups keeps each group whole;
- `mlp.linear_fc1`: [gate; up] stacked on the output dimension (Megatron's gated linear unit takes the first half
  as the gate);
- MoE experts as Megatron's `SequentialMLP` (`experts.local_experts.E.linear_fc{1,2}.weight`) or its grouped
  layout (`experts.linear_fc{1,2}.weightE`, TEGroupedMLP's per-expert tensors).
Conversion only moves and concatenates tensors: the round trip is bitwise and keeps the checkpoint's dtype.
A layer is MoE when its checkpoint has a router (`mlp.gate.weight`), so `mlp_only_layers` and
`decoder_sparse_step` come from the weights themselves.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass

import torch

from tic.core.errors import TicInputError

FAMILIES = ("qwen3", "qwen3_moe", "llama")
EXPERT_LAYOUTS = ("sequential", "grouped")

# per-layer renames that move a tensor unchanged: HF suffix -> Megatron suffix (after "model.layers.N." and
# "decoder.layers.N.")
_LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
    "mlp.gate.weight": "mlp.router.weight",
}
_GLOBAL_RENAMES = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}


@dataclass(frozen=True)
class AttentionShape:
    heads: int
    groups: int
    head_dim: int

    @classmethod
    def of(cls, cfg: dict) -> "AttentionShape":
        heads = int(cfg["num_attention_heads"])
        groups = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        if heads % groups:
            raise TicInputError(f"config.json: num_attention_heads {heads} is not a multiple of "
                                f"num_key_value_heads {groups}")
        return cls(heads, groups, head_dim)


def num_experts(cfg: dict) -> int:
    """Routed experts per MoE layer (0: dense); transformers writes num_experts or num_local_experts by release."""
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


def check_family(cfg: dict) -> None:
    """One line for a config this converter does not cover (before any weight is read)."""
    kind = cfg.get("model_type")
    if kind not in FAMILIES:
        raise TicInputError(f"train.engine megatron: model_type {kind!r} is not converted (covered: "
                            f"{', '.join(FAMILIES)})")
    if cfg.get("mlp_bias"):
        raise TicInputError("train.engine megatron: mlp_bias is not converted")


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: AttentionShape) -> torch.Tensor:
    """HF q/k/v rows (weight [out, in] or bias [out]) -> Megatron's linear_qkv rows, grouped per query group."""
    per = shape.heads // shape.groups
    tail = q.shape[1:]
    q = q.reshape(shape.groups, per * shape.head_dim, *tail)
    k = k.reshape(shape.groups, shape.head_dim, *tail)
    v = v.reshape(shape.groups, shape.head_dim, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def split_qkv(qkv: torch.Tensor, shape: AttentionShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of fuse_qkv."""
    per = shape.heads // shape.groups
    tail = qkv.shape[1:]
    grouped = qkv.reshape(shape.groups, (per + 2) * shape.head_dim, *tail)
    q, k, v = grouped.split([per * shape.head_dim, shape.head_dim, shape.head_dim], dim=1)
    return (q.reshape(-1, *tail).contiguous(), k.reshape(-1, *tail).contiguous(),
            v.reshape(-1, *tail).contiguous())


def _expert_name(layer: str, e: int, fc: int, layout: str) -> str:
    if layout == "sequential":
        return f"{layer}mlp.experts.local_experts.{e}.linear_fc{fc}.weight"
    return f"{layer}mlp.experts.linear_fc{fc}.weight{e}"


def _layers(names, prefix: str) -> list[int]:
    return sorted({int(n[len(prefix):].split(".", 1)[0]) for n in names if n.startswith(prefix)})


def _experts(names, layer: str) -> list[int]:
    pre = f"{layer}mlp.experts."
    return sorted({int(n[len(pre):].split(".", 1)[0]) for n in names if n.startswith(pre)})


def _take(src: dict, name: str, seen: set) -> torch.Tensor:
    seen.add(name)
    return src[name]


@dataclass(frozen=True)
class Move:
    """One Megatron tensor and the checkpoint tensors it is made of: moved unchanged ("copy"), q/k/v grouped per
    query group ("qkv", fuse_qkv) or stacked on the output dimension ("cat", [gate; up])."""

    megatron: str
    hf: tuple[str, ...]
    how: str = "copy"


def conversion_plan(hf_names, cfg: dict, experts: str = "sequential") -> list[Move]:
    """Where every checkpoint tensor goes (by name alone, no tensor read): the conversion hf_to_megatron runs and
    the name map others read (the locator matches modules by it). Tied embeddings: no output_layer (Megatron
    shares the embedding when share_embeddings_and_output_weights). Every HF tensor must land somewhere."""
    check_family(cfg)
    if experts not in EXPERT_LAYOUTS:
        raise TicInputError(f"expert layout {experts!r}: one of {', '.join(EXPERT_LAYOUTS)}")
    names, plan = set(hf_names), []
    for hf_name, mg_name in _GLOBAL_RENAMES.items():
        if hf_name in names and not (hf_name == "lm_head.weight" and cfg.get("tie_word_embeddings")):
            plan.append(Move(mg_name, (hf_name,)))
    for i in _layers(names, "model.layers."):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        plan += [Move(dst + b, (src + a,)) for a, b in _LAYER_RENAMES.items() if src + a in names]
        att = src + "self_attn."
        for kind in ("weight", "bias"):
            if f"{att}q_proj.{kind}" in names:
                plan.append(Move(f"{dst}self_attention.linear_qkv.{kind}",
                                 tuple(f"{att}{p}_proj.{kind}" for p in "qkv"), "qkv"))
        if f"{src}mlp.gate_proj.weight" in names:
            plan.append(Move(f"{dst}mlp.linear_fc1.weight", (f"{src}mlp.gate_proj.weight", f"{src}mlp.up_proj.weight"),
                             "cat"))
        for e in _experts(names, src):
            ex = f"{src}mlp.experts.{e}."
            plan.append(Move(_expert_name(dst, e, 1, experts), (ex + "gate_proj.weight", ex + "up_proj.weight"), "cat"))
            plan.append(Move(_expert_name(dst, e, 2, experts), (ex + "down_proj.weight",)))
    left = sorted(names - {h for m in plan for h in m.hf} - {"lm_head.weight"})  # tied: the embedding carries it
    if left:
        raise TicInputError(f"megatron conversion: {len(left)} checkpoint tensor(s) have no Megatron place, "
                            f"first {left[0]}")
    return plan


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def module_map(plan: list[Move]) -> dict[str, str]:
    """HF module name -> Megatron module name (under the GPTModel), from the converter's plan, for whoever compares
    the two models module by module (the locator, C2's fidelity check): for each HF module that holds weights (a
    tensor's module or an ancestor of one), the deepest Megatron module that holds every Megatron tensor they were
    converted into. Where several HF modules come to one Megatron module, the deepest of them has it, and none when
    two of that depth do (q/k/v all land in linear_qkv: none of them is it)."""
    held: dict[str, set[str]] = defaultdict(set)
    for move in plan:
        for name in move.hf:
            for hf_module in _ancestors(name.rsplit(".", 1)[0]):
                held[hf_module].add(move.megatron.rsplit(".", 1)[0])
    claims: dict[str, list[str]] = defaultdict(list)
    for hf_module, mg_modules in held.items():
        common = os.path.commonprefix([m.split(".") for m in mg_modules])
        if common:
            claims[".".join(common)].append(hf_module)
    out = {}
    for mg_module, hf_modules in claims.items():
        depth = max(h.count(".") for h in hf_modules)
        deepest = [h for h in hf_modules if h.count(".") == depth]
        if len(deepest) == 1:
            out[deepest[0]] = mg_module
    return out


def hf_to_megatron(hf: dict[str, torch.Tensor], cfg: dict, experts: str = "sequential") -> dict[str, torch.Tensor]:
    """Checkpoint tensors (HF names) -> GPTModel state (Megatron names), by conversion_plan."""
    shape, out = AttentionShape.of(cfg), {}
    for move in conversion_plan(hf, cfg, experts):
        parts = [hf[h] for h in move.hf]
        out[move.megatron] = fuse_qkv(*parts, shape) if move.how == "qkv" else \
            torch.cat(parts) if move.how == "cat" else parts[0]
    return out


def megatron_to_hf(mg: dict[str, torch.Tensor], cfg: dict, experts: str = "sequential") -> dict[str, torch.Tensor]:
    """GPTModel state (Megatron names) -> checkpoint tensors (HF names); inverse of hf_to_megatron. Megatron's
    `_extra_state` entries (Transformer Engine's FP8 metadata) are not weights and are dropped."""
    check_family(cfg)
    mg = {k: v for k, v in mg.items() if not k.endswith("_extra_state")}
    shape, out, seen = AttentionShape.of(cfg), {}, set()
    for hf_name, mg_name in _GLOBAL_RENAMES.items():
        if mg_name in mg:
            out[hf_name] = _take(mg, mg_name, seen)
    for i in _layers(mg, "decoder.layers."):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        for a, b in _LAYER_RENAMES.items():
            if src + b in mg:
                out[dst + a] = _take(mg, src + b, seen)
        for kind in ("weight", "bias"):
            name = f"{src}self_attention.linear_qkv.{kind}"
            if name in mg:
                for p, t in zip("qkv", split_qkv(_take(mg, name, seen), shape)):
                    out[f"{dst}self_attn.{p}_proj.{kind}"] = t
        if f"{src}mlp.linear_fc1.weight" in mg:
            gate, up = _take(mg, f"{src}mlp.linear_fc1.weight", seen).chunk(2)
            out[f"{dst}mlp.gate_proj.weight"], out[f"{dst}mlp.up_proj.weight"] = gate.contiguous(), up.contiguous()
        e = 0
        while _expert_name(src, e, 1, experts) in mg:
            gate, up = _take(mg, _expert_name(src, e, 1, experts), seen).chunk(2)
            ex = f"{dst}mlp.experts.{e}."
            out[ex + "gate_proj.weight"], out[ex + "up_proj.weight"] = gate.contiguous(), up.contiguous()
            out[ex + "down_proj.weight"] = _take(mg, _expert_name(src, e, 2, experts), seen)
            e += 1
    left = sorted(set(mg) - seen)
    if left:
        raise TicInputError(f"megatron conversion: {len(left)} Megatron tensor(s) have no checkpoint place "
                            f"(expert layout {experts!r}?), first {left[0]}")
    return out


def fused_expert_layout(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names -> the module layout transformers 5 loads MoE experts into: per layer
    `mlp.experts.gate_up_proj` [E, 2I, H] (each expert's [gate; up]) and `mlp.experts.down_proj` [E, H, I];
    every other tensor unchanged. What an HF model's named_parameters (C7's reference) call them."""
    out, layers = {}, {}
    for name, t in hf.items():
        head, sep, tail = name.partition(".mlp.experts.")
        if not sep:
            out[name] = t
            continue
        e, proj = tail.split(".", 1)
        layers.setdefault(head, {})[(int(e), proj)] = t
    for head, parts in layers.items():
        count = 1 + max(e for e, _ in parts)
        out[f"{head}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate_proj.weight")], parts[(e, "up_proj.weight")]]) for e in range(count)])
        out[f"{head}.mlp.experts.down_proj"] = torch.stack([parts[(e, "down_proj.weight")] for e in range(count)])
    return out
