"""Consistent CPU kernels: every token row goes through the same call with the same shapes.

Why: CPU kernels pick blocking, vector/scalar tails and thread splits from the whole tensor's shape, so a
token's result depends on how many rows sit beside it (batch, padding, prefill vs decode). Here each
per-token operator (linear, norm, activation, router, experts, log-softmax) runs on one row at a time, rotary
angles come from one precomputed table, and attention runs per query row over exactly that sequence's keys in
order. A token's arithmetic then depends only on its own sequence, which is what both sides must share.

`apply(model)` patches an HF model in place; module names stay, so capture and localisation still work.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

ATTN_NAME = "tic_rowwise"


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


def _linear_forward(self, x):
    return row_linear(x, self.weight, self.bias)


def _rmsnorm_forward(self, x):
    eps = getattr(self, "variance_epsilon", getattr(self, "eps", 1e-6))
    dtype = x.dtype

    def one(r):
        r32 = r.to(torch.float32)
        var = r32.pow(2).mean(-1, keepdim=True)
        return self.weight * (r32 * torch.rsqrt(var + eps)).to(dtype)

    return rowwise(one, x)


class _RowAct(nn.Module):
    def __init__(self, act: nn.Module):
        super().__init__()
        self.act = act

    def forward(self, x):
        return rowwise(self.act, x)


def _rotary_forward(self, x, position_ids):
    """cos/sin looked up from a table computed once at a fixed shape (as vLLM's cos_sin_cache)."""
    table = getattr(self, "_tic_table", None)
    need = int(position_ids.max()) + 1 if position_ids.numel() else 1
    if table is None or table[0].shape[0] < need:
        n = max(need, int(getattr(self, "max_seq_len_cached", 0) or 0), 1)
        pos = torch.arange(n, dtype=torch.float32)[None, :]
        cos, sin = self._tic_orig_forward(torch.zeros(1, dtype=torch.float32), pos)
        table = (cos[0], sin[0])
        self._tic_table = table
    cos, sin = table
    return cos[position_ids].to(x.dtype), sin[position_ids].to(x.dtype)


def _moe_forward(self, hidden_states):
    """Row-wise routed experts: fp32 router softmax, top-k per row, outputs summed in fp32 in slot order."""
    router, experts = self.gate, self.experts
    shape, dtype = hidden_states.shape, hidden_states.dtype
    x = hidden_states.reshape(-1, shape[-1])
    top_k = router.top_k
    norm = getattr(router, "norm_topk_prob", True)
    act = experts.act_fn
    outs = []
    for r in x.split(1, dim=0):
        logits = F.linear(r, router.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        w, idx = torch.topk(probs, top_k, dim=-1)
        if norm:
            w = w / w.sum(dim=-1, keepdim=True)
        w = w.to(dtype)
        acc = torch.zeros(1, shape[-1], dtype=torch.float32)
        for slot in range(top_k):
            e = int(idx[0, slot])
            gate, up = F.linear(r, experts.gate_up_proj[e]).chunk(2, dim=-1)
            h = F.linear(act(gate) * up, experts.down_proj[e])
            acc = acc + (h * w[0, slot]).to(torch.float32)
        outs.append(acc.to(dtype))
    return torch.cat(outs, dim=0).reshape(shape)


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


def _mask_for_rowwise(*args, **kwargs):
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, rowwise_attention)
    AttentionMaskInterface.register(ATTN_NAME, _mask_for_rowwise)


def _is_rmsnorm(m: nn.Module) -> bool:
    return type(m).__name__.endswith("RMSNorm") and hasattr(m, "weight")


def _is_moe_block(m: nn.Module) -> bool:
    return (hasattr(m, "gate") and hasattr(m, "experts") and hasattr(getattr(m, "experts"), "gate_up_proj")
            and hasattr(m.gate, "weight") and hasattr(m.gate, "top_k"))


_ACT_TYPES = ("SiLU", "SiLUActivation", "GELUActivation", "NewGELUActivation", "GELU", "ReLU",
              "PytorchGELUTanh", "GELUTanh")


def apply(model: nn.Module) -> nn.Module:
    """Patch an HF causal LM in place so that every operator is row-invariant. Idempotent."""
    if getattr(model, "_tic_consistent", False):
        return model
    register_attention()
    unsupported = []
    for name, m in list(model.named_modules()):
        if _is_moe_block(m):
            if any(hasattr(m, a) for a in ("shared_expert", "shared_experts")):
                unsupported.append(f"{name} (shared experts)")
            m.forward = types.MethodType(_moe_forward, m)
        elif isinstance(m, nn.Linear):
            m.forward = types.MethodType(_linear_forward, m)
        elif _is_rmsnorm(m):
            m.forward = types.MethodType(_rmsnorm_forward, m)
        elif type(m).__name__.endswith("RotaryEmbedding"):
            m._tic_orig_forward = m.forward
            m.forward = types.MethodType(_rotary_forward, m)
        for attr, child in list(m.named_children()):
            if type(child).__name__ in _ACT_TYPES:
                setattr(m, attr, _RowAct(child))
    if unsupported:
        from tic.core.errors import TicInputError

        raise TicInputError("consistent CPU kernels do not cover: " + ", ".join(unsupported))
    model.config._attn_implementation = ATTN_NAME
    for sub in model.modules():
        cfg = getattr(sub, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = ATTN_NAME
    model._tic_consistent = True
    return model
