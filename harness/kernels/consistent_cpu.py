"""Consistent CPU kernels: every token row goes through the same call with the same shapes.

Why: CPU kernels pick blocking, vector/scalar tails and thread splits from the whole tensor's shape, so a
token's result depends on how many rows sit beside it (batch, padding, prefill vs decode). Here each
per-token operator (linear, norm, activation, router, experts, log-softmax) runs on one row at a time, rotary
angles come from one precomputed table, and attention runs per query row over exactly that sequence's keys in
order. A token's arithmetic then depends only on its own sequence, which is what both sides must share.

`CPUProvider` answers the autograd wrappers' calls (spec.py) with these kernels: `kernels: consistent`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tic.harness.kernels import fp8_cpu
from tic.harness.kernels.autograd import PLAIN_ACTS, gate_output_ref, layer_norm_float32_written_out
from tic.harness.kernels.fp8_rule import DEFAULT_KV as FP8_KV_RULE
from tic.harness.kernels.mamba import MambaCPUKernels
from tic.harness.kernels.rope import hf_cos_sin_cache, rotate_interleaved, rotate_neox
from tic.harness.kernels.routing import as_routing, route
from tic.harness.kernels.spec import KernelProvider


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


def rowwise_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, softcap=None, window=None,
                      fp8_kv: bool = False, sinks=None, **kwargs):
    """Attention one query row at a time over exactly the keys its mask allows, in sequence order.

    query [B, H, Q, D], key/value [B, Hkv, K, D], attention_mask bool [B, 1, Q, K] (True = attend; a sliding
    window is already in it, as HF builds it per layer type) or None (causal, the last `window` keys when
    given). softcap: the scores cap * tanh(s / cap) in the model dtype, before the mask (HF's eager order).
    fp8_kv: an FP8 KV cache's attention, FlashAttention's FP8 forward in value (fp8_rule.DEFAULT_KV).
    sinks [H]: a learned logit per head beside every row's keys, in the softmax and dropped from it (GPT-OSS).
    """
    if sinks is not None and fp8_kv:
        raise ValueError("attention sinks with an FP8 KV cache: not implemented by the consistent kernels")
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
                idx = torch.arange(max(0, K - Q + q + 1 - window) if window else 0, K - Q + q + 1)
            if idx.numel() == 0:
                continue  # a padding query row: no keys, output stays zero
            k = key[b][:, idx].repeat_interleave(rep, dim=0)  # [H, n, D]
            v = value[b][:, idx].repeat_interleave(rep, dim=0)
            qr = query[b, :, q : q + 1]  # [H, 1, D]
            if fp8_kv:  # one row through the whole rule, k and v already per query head
                out[b, q] = FP8_KV_RULE.attention(qr[None], k[None], v[None], None, scaling, 1, softcap)[0, 0]
                continue
            scores = torch.matmul(qr, k.transpose(1, 2)) * scaling
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            if sinks is not None:
                logits = torch.cat([scores.float(), sinks.float().reshape(-1, 1, 1)], dim=-1)
                probs = torch.softmax(logits, dim=-1)[..., :-1].to(query.dtype)
            else:
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
            out[b, q] = torch.matmul(probs, v)[:, 0]
    return out, None


class CPUProvider(MambaCPUKernels, KernelProvider):  # Mamba-2 kernels: tic.harness.kernels.mamba
    """tic's consistent CPU kernels: each token row through the same call with the same shapes."""

    name = "cpu"

    def __init__(self, kv_cache_dtype: str = "auto"):
        """kv_cache_dtype: fp8 makes attention round q, k, v and P as FlashAttention's FP8 forward does."""
        self.kv_cache_dtype = kv_cache_dtype

    def linear(self, x, w, b=None):
        return row_linear(x, w, b)

    def rms_norm(self, x, w, eps, offset: float = 0.0):
        """w * x_hat with x_hat rounded to the model dtype first (Llama's order); with an offset, (offset + w) *
        x_hat in float32 rounded once (Gemma's (1 + w), as HF's Gemma norms and vLLM's GemmaRMSNorm)."""
        dtype = x.dtype
        w_eff = (w.float() + offset) if offset else None

        def one(r):
            r32 = r.to(torch.float32)
            var = r32.pow(2).mean(-1, keepdim=True)
            if w_eff is not None:
                return (r32 * torch.rsqrt(var + eps) * w_eff).to(dtype)
            return w * (r32 * torch.rsqrt(var + eps)).to(dtype)

        return rowwise(one, x)

    def add_rms_norm(self, x, residual, w, eps, offset: float = 0.0):
        total = x + residual
        # the offset as a keyword only when set: a provider built on this one may know only w * x_hat (a plant)
        return self.rms_norm(total, w, eps, **({"offset": offset} if offset else {})), total

    def cos_sin_cache(self, rotary, config, n, dtype, device, layer_type=None):
        return hf_cos_sin_cache(rotary, n, dtype, device, layer_type)

    def rotary(self, q, k, positions, cos_sin):
        return rotate_neox(q, positions, cos_sin), rotate_neox(k, positions, cos_sin)

    def rotary_interleaved(self, q, k, positions, cos_sin):
        return rotate_interleaved(q, positions, cos_sin), rotate_interleaved(k, positions, cos_sin)

    def silu_and_mul(self, x):
        half = x.shape[-1] // 2
        return rowwise(lambda r: (F.silu(r[:, :half].float()) * r[:, half:].float()).to(x.dtype), x)

    def gelu_tanh_and_mul(self, x):
        half = x.shape[-1] // 2
        return rowwise(lambda r: (F.gelu(r[:, :half].float(), approximate="tanh") * r[:, half:].float()).to(x.dtype),
                       x)

    def softcap(self, x, cap):
        """cap * tanh(x / cap) in x's dtype, one row at a time (CPU tanh takes another path for a tensor's
        vector tail, so a whole-batch call would round a row by where it sits)."""
        return rowwise(lambda r: torch.tanh(r / cap) * cap, x)

    def per_row(self, module, x):
        """A module of the model's own that acts on each row alone (coverage.acts_per_row), one row at a time, in
        float32 and rounded once to x's dtype, as tic's other activations (a bf16 xIELU's expm1(x) - x is 0 for
        small x, and its alpha_n would get no gradient): autograd trains its parameters through it."""
        return rowwise(lambda r: module(r.float()).to(r.dtype), x)

    def per_token_experts(self, experts, x, weights, ids):
        """Routed experts of the model's own that act on each token alone (coverage.experts_act_per_token), their
        forward on one token's row, top-k ids and weights at a time, in the model's dtype (their weights are in
        it): batch-invariant by construction, and autograd trains their parameters through their own code."""
        if x.shape[0] == 0:
            return experts(x, ids, weights)
        return torch.cat([experts(x[i:i + 1], ids[i:i + 1], weights[i:i + 1]) for i in range(x.shape[0])])

    def activation(self, x, kind):
        """An ungated MLP's activation one row at a time (CPU erf/tanh take another path for a vector's tail)."""
        return rowwise(PLAIN_ACTS[kind], x)

    def layer_norm(self, x, w, b, eps):
        return rowwise(lambda r: F.layer_norm(r, (x.shape[-1],), w, b, eps), x)

    def layer_norm_float32(self, x, w, b, eps):
        return rowwise(lambda r: layer_norm_float32_written_out(r, w, b, eps), x)

    def sigmoid_gate(self, g, y):
        """sigmoid(g) * y one row at a time (CPU sigmoid, like tanh, takes another path for a vector's tail)."""
        rows = [torch.sigmoid(g[i:i + 1]) * y[i:i + 1] for i in range(g.shape[0])]
        return torch.cat(rows) if rows else y.clone()

    def output_gate(self, g, y, function, per_head):
        """An attention output times its gate's function, one token row at a time (CPU sigmoid and softplus take
        another path for a vector's tail)."""
        g2, y2 = g.reshape(-1, g.shape[-1]), y.reshape(-1, y.shape[-1])
        rows = [gate_output_ref(g2[i:i + 1], y2[i:i + 1], function, per_head) for i in range(y2.shape[0])]
        return (torch.cat(rows) if rows else y2.clone()).reshape(y.shape)

    def attention(self, q, k, v, mask, scale, softcap=None, window=None, sinks=None):
        return rowwise_attention(None, q, k, v, mask, scale, softcap=softcap, window=window,
                                 fp8_kv=str(self.kv_cache_dtype).startswith("fp8"), sinks=sinks)[0]

    def moe_route(self, logits, top_k, routing, bias=None):
        """One row at a time: a softmax router as route_topk, any other routing by tic.harness.kernels.routing."""
        rule = as_routing(routing)
        one = (lambda r: route_topk(r, top_k, rule.renormalize)) if rule.plain else \
            (lambda r: route(r, bias, top_k, rule))
        outs = [one(r) for r in logits.split(1, dim=0)]
        if not outs:
            return logits.new_zeros(0, top_k, dtype=torch.float32), torch.zeros(0, top_k, dtype=torch.long)
        return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])

    def moe_expert_rows(self, x, e: int, gate_up, down):
        """Expert e's unweighted output for each row of x [n, H], one row per call."""
        return torch.cat([F.linear(self.silu_and_mul(F.linear(r, gate_up[e])), down[e]) for r in x.split(1)]) \
            if x.shape[0] else x.new_zeros(0, x.shape[1])

    def moe_experts(self, x, weights, ids, gate_up, down):
        return self._combine_slots(x, weights, ids,
                                   lambda r, e: F.linear(self.silu_and_mul(F.linear(r, gate_up[e])), down[e]))

    def _combine_slots(self, x, weights, ids, expert):
        """The expert-parallel merge rule (tic.harness.engines.parallel.combine_slot_order) one row at a time: each
        slot's output expert(row, e) times its weight in the model dtype, summed in fp32 in top-k slot order."""
        dtype, outs = x.dtype, []
        for t in range(x.shape[0]):
            r = x[t:t + 1]
            acc = torch.zeros(1, x.shape[1], dtype=torch.float32)
            for slot in range(ids.shape[1]):
                h = expert(r, int(ids[t, slot]))
                acc = acc + (h * weights[t, slot].to(dtype)).to(torch.float32)
            outs.append(acc.to(dtype))
        return torch.cat(outs) if outs else x.new_zeros(0, x.shape[1])

    def log_softmax(self, logits):
        return row_log_softmax(logits.float())

    # -- block FP8 (tic.harness.kernels.fp8): dynamic per-token-group activations, the block-scaled GEMM ---------
    def fp8_linear(self, x, wq, ws, b, block, checkpoint=None):
        return fp8_cpu.fp8_linear(x, wq, ws, b, block)

    def fp8_moe_experts(self, x, weights, ids, gu_q, gu_s, d_q, d_s, block, with_intermediate: bool = False):
        """moe_experts' merge rule over FP8 expert GEMMs: each expert's input quantized per token, SiLU*mul
        rounded once, then quantized again for the down projection (method 4.4). with_intermediate: also the
        SiLU*mul rows, one per (token, top-k slot) in that order."""
        between = []

        def expert(r, e):
            h = self.silu_and_mul(fp8_cpu.fp8_linear(r, gu_q[e], gu_s[e], None, block))
            between.append(h)
            return fp8_cpu.fp8_linear(h, d_q[e], d_s[e], None, block)

        out = self._combine_slots(x, weights, ids, expert)
        if not with_intermediate:
            return out
        return out, torch.cat(between) if between else None


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 softmax, top-k by a stable descending sort (a tie goes to the lower expert id), renormalised."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    ids = torch.sort(probs, dim=-1, descending=True, stable=True).indices[..., :top_k]
    w = probs.gather(-1, ids)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, ids
