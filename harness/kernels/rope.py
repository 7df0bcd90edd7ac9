"""Rotary embedding, neox-style (the two halves of the rotated features paired) or interleaved (features 2i and 2i+1
paired: GLM, vLLM's is_neox_style=False): q/k rotated by a cos|sin table looked up per position, and that table as
an HF rotary module computes it. The CPU provider's kernels, autograd's references and the vLLM provider's fallback
table all come from here."""

from __future__ import annotations

import copy

import torch
from torch import nn


def rotate_neox(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary on the first R dims of x [T, H, D] with cos|sin rows looked up per position, in
    x's dtype (HF's apply_rotary_pos_emb arithmetic)."""
    rot = cos_sin.shape[-1]
    cos, sin = cos_sin[positions].to(x.dtype).chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
    xr, rest = x[..., :rot], x[..., rot:]
    x1, x2 = xr.chunk(2, dim=-1)
    out = xr * cos + torch.cat([-x2, x1], dim=-1) * sin
    return torch.cat([out, rest], dim=-1) if rest.numel() else out


def rotate_interleaved(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Interleaved rotary on the first R dims of x [T, H, D]: the pair (x[2i], x[2i+1]) turned by the angle of
    table column i, in x's dtype (HF's GLM apply_rotary_pos_emb arithmetic: x * cos + rotate_every_two(x) * sin)."""
    rot = cos_sin.shape[-1]
    cos, sin = cos_sin[positions].to(x.dtype).chunk(2, dim=-1)
    cos, sin = cos.repeat_interleave(2, dim=-1)[:, None], sin.repeat_interleave(2, dim=-1)[:, None]
    xr, rest = x[..., :rot], x[..., rot:]
    turned = torch.stack((-xr[..., 1::2], xr[..., 0::2]), dim=-1).flatten(-2)
    out = xr * cos + turned * sin
    return torch.cat([out, rest], dim=-1) if rest.numel() else out


def _rotary_output(rotary: nn.Module, n: int, device, layer_type: str | None = None):
    pos = torch.arange(n, dtype=torch.float32, device=device)[None]
    forward = getattr(rotary, "_tic_orig_forward", rotary)
    extra = (layer_type,) if layer_type is not None else ()
    with torch.no_grad():
        return forward(torch.zeros(1, dtype=torch.float32, device=device), pos, *extra)


def rotary_output_layout(rotary: nn.Module) -> str:
    """"halves" when an HF rotary module's cos repeats its R/2 angles as two halves (Llama), "pairs" when it
    repeats each angle twice in a row (Cohere), "once" when it holds each once (GPT-OSS); read on a few positions
    (a module that does not run on the CPU probe reads as halves, the common layout, and C2 still compares the
    forward)."""
    probe = copy.copy(rotary)  # shallow: the module's settings, a CPU inv_freq of its own, the class's own forward
    probe._buffers = dict(probe._buffers)
    freqs = probe._buffers.get("inv_freq")
    if isinstance(freqs, torch.Tensor) and freqs.dim() == 1:  # the values do not matter, only where they go
        probe._buffers["inv_freq"] = torch.linspace(0.1, 1.0, freqs.shape[0])
    try:
        with torch.no_grad():
            cos, _ = type(rotary).forward(probe, torch.zeros(1), torch.arange(4, dtype=torch.float32)[None])
    except Exception:  # noqa: BLE001 - a per-layer-type module or another signature: the common layout
        return "halves"
    return _layout_of(cos)


def sin_negated(cos_sin: torch.Tensor) -> torch.Tensor:
    """A cos|sin table with its sin half negated: the same rotations turn each angle the other way (an exact sign
    flip in any dtype)."""
    cos, sin = cos_sin.chunk(2, dim=-1)
    return torch.cat([cos, -sin], dim=-1)


def spread_angles(v: torch.Tensor, layout: str) -> torch.Tensor:
    """Rows of R/2 angles' cos (or sin) laid out as an HF rotary module of `layout` (rotary_output_layout) returns
    them: two halves, each angle twice in a row, or each once."""
    if layout == "pairs":
        return v.repeat_interleave(2, dim=-1)
    return v if layout == "once" else torch.cat([v, v], dim=-1)


def _layout_of(cos: torch.Tensor) -> str:
    """"pairs" for cos rows [.., R] that repeat each angle twice in a row and not as two halves, "once" for rows
    [.., R/2] that hold each angle once (GPT-OSS's, which its rotation spreads over both halves), else "halves".
    Read on rows of several positions: at position 0 every layout is all ones."""
    half = cos.shape[-1] // 2
    if torch.equal(cos[..., :half], cos[..., half:]):
        return "halves"
    return "pairs" if torch.equal(cos[..., 0::2], cos[..., 1::2]) else "once"


def hf_cos_sin_cache(rotary: nn.Module, n: int, dtype: torch.dtype, device, layer_type: str | None = None) \
        -> torch.Tensor:
    """cos|sin [n, rot] (each R/2 angles once) from an HF rotary module (its inv_freq, rope scaling and attention
    factor), float32 arithmetic, then cast to dtype; `layer_type` picks one table of a module that holds one per
    layer type (Gemma-3). The module's own layout, halves, pairs or once, is read from the rows it returns (or the
    angles as complex numbers, DeepSeek-V2's). A module the wrappers patched is read through its own forward."""
    out = _rotary_output(rotary, max(n, 4), device, layer_type)  # positions enough to read the layout from
    if isinstance(out, torch.Tensor) and out.is_complex():  # DeepSeek-V2's: cos + i sin of each angle, [1, n, R/2]
        return torch.cat([out.real[0, :n], out.imag[0, :n]], dim=-1).to(dtype)
    cos, sin = out
    layout = _layout_of(cos)
    cos, sin = cos[0, :n], sin[0, :n]
    if layout == "pairs":
        return torch.cat([cos[:, 0::2], sin[:, 0::2]], dim=-1).to(dtype)
    if layout == "once":
        return torch.cat([cos, sin], dim=-1).to(dtype)
    half = cos.shape[-1] // 2
    return torch.cat([cos[:, :half], sin[:, :half]], dim=-1).to(dtype)
