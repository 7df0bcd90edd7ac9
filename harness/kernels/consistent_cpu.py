"""Consistent CPU kernels: every token row goes through the same call with the same shapes.

Why: CPU kernels pick blocking, vector/scalar tails and thread splits from the whole tensor's shape, so a
token's result depends on how many rows sit beside it (batch, padding, prefill vs decode). Here each
per-token operator (linear, norm, activation, router, experts, log-softmax) runs on one row at a time, rotary
angles come from one precomputed table, and attention runs per query row over exactly that sequence's keys in
order. A token's arithmetic then depends only on its own sequence, which is what both sides must share.

`apply(model)` routes an HF model through these kernels with the autograd wrappers (modules.py, providers.py);
module names stay, so capture and localisation still work.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rows(x: torch.Tensor) -> list[torch.Tensor]:
    return list(x.reshape(-1, x.shape[-1]).split(1, dim=0))


def rowwise(fn, x: torch.Tensor) -> torch.Tensor:
    """Apply fn to each [1, D] row of x; the output keeps x's leading shape."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] == 0:
        return fn(flat)
    out = torch.cat([fn(r) for r in flat.split(1, dim=0)], dim=0)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return rowwise(lambda r: F.linear(r, weight, bias), x)


def row_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return rowwise(lambda r: torch.log_softmax(r, dim=-1), logits)


def rowwise_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Attention one query row at a time over exactly the keys its mask allows, in sequence order.

    query [B, H, Q, D], key/value [B, Hkv, K, D], attention_mask bool [B, 1, Q, K] (True = attend).
    """
    B, H, Q, D = query.shape
    Hkv, K = key.shape[1], key.shape[2]
    rep = H // Hkv
    out = torch.zeros(B, Q, H, value.shape[-1], dtype=query.dtype)
    for b in range(B):
        for q in range(Q):
            if attention_mask is not None:
                allowed = attention_mask[b, 0, q]
                if allowed.dtype != torch.bool:
                    allowed = allowed == 0
                idx = allowed.nonzero().flatten()
            else:
                idx = torch.arange(K - Q + q + 1)
            if idx.numel() == 0:
                continue  # a padding query row: no keys, output stays zero
            k = key[b][:, idx].repeat_interleave(rep, dim=0)  # [H, n, D]
            v = value[b][:, idx].repeat_interleave(rep, dim=0)
            qr = query[b, :, q : q + 1]  # [H, 1, D]
            scores = torch.matmul(qr, k.transpose(1, 2)) * scaling
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
            out[b, q] = torch.matmul(probs, v)[:, 0]
    return out, None


def apply(model: nn.Module) -> nn.Module:
    """Patch an HF causal LM in place so that every operator runs these kernels through tic's autograd
    wrappers (harness/kernels/modules.py). Idempotent."""
    from tic.harness.kernels.modules import apply as apply_provider
    from tic.harness.kernels.providers import get_provider

    return apply_provider(model, get_provider("consistent"))
