"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4-MoE-Lite, MiniCPM3, Youtu, ...): recognised, its rotary
layout read from the module's own forward, and computed through the kernel provider's operators.

The query comes from q_proj, or from a low-rank q_a_proj, its norm and q_b_proj; the keys and values from one
latent (kv_a_proj_with_mqa: kv_lora_rank features, then the rotary features every head shares), the latent's norm
and kv_b_proj, which gives each head its non-rotary key features and its value. Each head's key is its own
non-rotary features then the shared rotary ones, and so is its query. The value may be narrower than the key.

Models lay the rotary features out differently: rotated as two halves (neox) or as pairs turned together.
DeepSeek-V3's `rope_interleave` turns pairs and writes the results back as two halves: q and k are then permuted
alike, so every score, and the attention, is that of pairs turned in place. `rope_layout` runs the module's
forward on a seeded copy against both layouts and keeps the one that matches; the wrapper (modules.py's
`_mla_attention_forward`) then rotates that way with the provider's rotary on the model's own cos|sin table.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from tic.harness.kernels.rope import rotate_interleaved, rotate_neox

PARTS = frozenset({"q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
                   "kv_b_proj", "o_proj"})
SIZES = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank", "num_heads")
LAYOUTS = ("neox", "pairs")


def _linear(m, name: str) -> bool:
    return isinstance(getattr(m, name, None), nn.Linear)


def is_mla_attention(m) -> bool:
    """A latent attention as DeepSeek-V2/V3 build it: kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj and o_proj,
    q_proj or q_a_proj with q_a_layernorm and q_b_proj, the head sizes as integers, the scaling and layer index."""
    if m is None or not all(_linear(m, n) for n in ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj")):
        return False
    query = _linear(m, "q_proj") or (_linear(m, "q_a_proj") and _linear(m, "q_b_proj")
                                     and isinstance(getattr(m, "q_a_layernorm", None), nn.Module))
    sizes = all(isinstance(getattr(m, n, None), int) and not isinstance(getattr(m, n), bool) for n in SIZES)
    return query and sizes and isinstance(getattr(m, "kv_a_layernorm", None), nn.Module) \
        and isinstance(getattr(m, "scaling", None), float) and hasattr(m, "layer_idx")


def query(m, x: torch.Tensor) -> torch.Tensor:
    """The query projection of x: q_proj, or q_a_proj, its norm and q_b_proj."""
    return m.q_proj(x) if _linear(m, "q_proj") else m.q_b_proj(m.q_a_layernorm(m.q_a_proj(x)))


def split_heads(m, q: torch.Tensor, latent: torch.Tensor, norm_latent, kv_b) -> tuple:
    """(q without rotary, q's rotary features, k without rotary, k's shared rotary features, v), per head
    [.., heads, features] (the shared rotary features on one head), from the query projection's output and the
    latent kv_a_proj_with_mqa gives; norm_latent and kv_b: the latent's norm and kv_b_proj, as callables."""
    nope, rot, vd, rank, heads = (int(getattr(m, n)) for n in SIZES)
    lead = q.shape[:-1]
    q = q.reshape(*lead, heads, nope + rot)
    ckv, k_rot = latent.split([rank, rot], dim=-1)
    kv = kv_b(norm_latent(ckv)).reshape(*lead, heads, nope + vd)
    k_nope, v = kv.split([nope, vd], dim=-1)
    return q[..., :nope], q[..., nope:], k_nope, k_rot.reshape(*lead, 1, rot), v


def rotate(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, layout: str) -> torch.Tensor:
    """x [T, H, R] rotated the way `layout` names, with HF's arithmetic (the reference and the probe)."""
    return (rotate_interleaved if layout == "pairs" else rotate_neox)(x, positions, cos_sin)


def _reference(m, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, layout: str) -> torch.Tensor:
    """The latent attention of x [1, T, hidden], causal, in x's dtype, rotating as `layout` says."""
    q_nope, q_rot, k_nope, k_rot, v = split_heads(m, query(m, x)[0], m.kv_a_proj_with_mqa(x)[0], m.kv_a_layernorm,
                                                  m.kv_b_proj)
    q_rot, k_rot = rotate(q_rot, positions, cos_sin, layout), rotate(k_rot, positions, cos_sin, layout)
    q = torch.cat([q_nope, q_rot], -1).transpose(0, 1)
    k = torch.cat([k_nope, k_rot.expand(*k_nope.shape[:-1], -1)], -1).transpose(0, 1)
    out = F.scaled_dot_product_attention(q, k, v.transpose(0, 1), is_causal=True, scale=m.scaling)
    return m.o_proj(out.transpose(0, 1).reshape(1, x.shape[1], -1))


_READINGS: dict = {}


def rope_layout(m: nn.Module, seeded_copy) -> tuple[str | None, str | None]:
    """(layout, problem): which of LAYOUTS the module's own forward rotates by, read on a seeded float32 copy
    (seeded_copy: coverage's) fed seeded cos|sin rows laid out as HF rotary modules give them (the angles twice,
    end to end), or those angles as complex numbers; (None, why) when its forward does not take (hidden_states,
    position_embeddings, attention_mask) or matches none of them. Read once per attention class and shapes: a
    model's layers share it, and a full-size copy of one is large."""
    key = (type(m), tuple((n, tuple(t.shape)) for n, t in m.named_parameters()),
           tuple(getattr(m, n) for n in SIZES), m.scaling, getattr(getattr(m, "config", None), "rope_interleave", None))
    if key not in _READINGS:
        _READINGS[key] = _read_rope_layout(m, seeded_copy)
    return _READINGS[key]


def _read_rope_layout(m: nn.Module, seeded_copy) -> tuple[str | None, str | None]:
    probe = seeded_copy(m).float()
    with torch.no_grad():  # unit-scale activations: with raw seeded weights the softmax saturates on one key,
        for lin in probe.modules():  # where every rotary layout gives the same output
            if isinstance(lin, nn.Linear):
                lin.weight.mul_(lin.in_features ** -0.5)
    if getattr(probe, "config", None) is not None:
        probe.config = copy.copy(probe.config)
        probe.config._attn_implementation = "eager"
    rot, t = int(m.qk_rope_head_dim), 5
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, t, probe.kv_a_proj_with_mqa.in_features, generator=g)
    angles = torch.randn(t, rot // 2, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    failed = None
    # HF rotary modules hand the attention (cos, sin) rows, or the angles as complex numbers (DeepSeek-V2)
    for rows in ((cos[None], sin[None]), torch.polar(torch.ones_like(angles), angles)[None]):
        try:
            with torch.no_grad():
                got = probe(hidden_states=x, position_embeddings=rows, attention_mask=mask)
            break
        except Exception as e:  # noqa: BLE001  another way of handing the rotary: try the next
            failed = failed or e
    else:
        return None, (f"a latent attention whose forward the probe cannot run ({type(failed).__name__}: "
                      f"{str(failed)[:80]})")
    got = got[0] if isinstance(got, tuple) else got
    table, positions = torch.cat([angles.cos(), angles.sin()], -1), torch.arange(t)
    with torch.no_grad():
        fits = [lay for lay in LAYOUTS
                if torch.allclose(got, _reference(probe, x, positions, table, lay), rtol=1e-4, atol=1e-5)]
    if len(fits) != 1:
        return None, ("a latent attention whose rotary turns neither the two halves (neox) nor pairs of features"
                      if not fits else f"a latent attention whose rotary layout the probe cannot tell ({fits})")
    return fits[0], None
