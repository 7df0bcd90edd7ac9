"""Autograd wrappers: forward values from a kernel provider, backward from a plain PyTorch reference.

The inference kernels define the values and training adds the backward (method 3.1). Each operator below is
one `autograd.Function`: forward calls the provider's kernel (the very kernel the rollout runs) and returns
its output unchanged; backward differentiates a plain PyTorch reference of the same operator, evaluated in
float32 on the inputs saved at forward (quantization and rounding treated as identity: a straight-through
estimator). Linear layers, the bulk of the cost, have their backward written out (two GEMMs) instead.

Every backward first checks that no weight it saw at forward changed since (tensor version and storage): an
optimizer step or weight sync between forward and backward would otherwise mix weight versions silently.

`planted_fault` lets tests corrupt one operator's backward (or change weights before it runs) without the
gates knowing about it: C7 must catch such faults by measurement alone.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class StaleWeightError(RuntimeError):
    """A weight changed between an operator's forward and its backward."""


class WeightGuard:
    """(version, storage) of every parameter an operator saw at forward."""

    def __init__(self, tensors):
        self.weights = [t for t in tensors if isinstance(t, nn.Parameter)]
        self.seen = [(w._version, w.data_ptr()) for w in self.weights]

    def check(self, op: str) -> None:
        for w, (version, ptr) in zip(self.weights, self.seen):
            if w._version != version or w.data_ptr() != ptr:
                raise StaleWeightError(
                    f"{op} backward: a weight {tuple(w.shape)} changed since its forward (version {version} -> "
                    f"{w._version}{', storage replaced' if w.data_ptr() != ptr else ''}); the gradient would mix "
                    "weight versions")


# -- planted faults (tests) -----------------------------------------------------------------------------------
_FAULTS: dict[str, list[tuple[Callable | None, Callable | None]]] = {}


@contextmanager
def planted_fault(op: str, grads: Callable[[tuple], tuple] | None = None,
                  before: Callable[[list[torch.Tensor]], None] | None = None):
    """While active, operator `op`'s backward runs `before(weights)` (under no_grad) before its weight check,
    and passes its input gradients through `grads(tuple) -> tuple` before returning them."""
    if op not in OPS:
        raise KeyError(f"no operator {op!r}; operators are {', '.join(OPS)}")
    entry = (grads, before)
    _FAULTS.setdefault(op, []).append(entry)
    try:
        yield
    finally:
        _FAULTS[op].remove(entry)


# -- references: plain PyTorch, float32, differentiable -------------------------------------------------------
def rms_norm_ref(x, w, eps):
    x32 = x.float()
    return w.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def add_rms_norm_ref(x, residual, w, eps):
    total = x.float() + residual.float()
    return rms_norm_ref(total, w, eps), total


def rotary_ref(q, k, positions, cos_sin):
    from tic.harness.kernels.providers import rotate_neox

    c = cos_sin.float()
    return rotate_neox(q.float(), positions, c), rotate_neox(k.float(), positions, c)


def silu_and_mul_ref(x):
    g, u = x.float().chunk(2, dim=-1)
    return F.silu(g) * u


def attention_ref(q, k, v, mask, scale):
    """q [B, H, Q, D], k/v [B, Hkv, K, D], mask bool [B, 1, Q, K] or None (causal) -> [B, Q, H, D].
    torch's SDPA in float32 (its fused backward on GPU); a query that sees no key (padding) gives 0."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(rep, dim=1), v.float().repeat_interleave(rep, dim=1)
    Q, K = q.shape[2], k.shape[2]
    if mask is None:
        mask = torch.ones(Q, K, dtype=torch.bool, device=q.device).tril(K - Q)[None, None]
    seen = mask.any(-1, keepdim=True)
    first = torch.arange(K, device=q.device) == 0
    safe = mask | (~seen & first)  # a fully masked row would give NaN: let it see key 0, then zero it
    out = F.scaled_dot_product_attention(q.float(), k, v, attn_mask=safe, scale=scale)
    return torch.where(seen, out, torch.zeros((), device=q.device)).transpose(1, 2)


def moe_route_ref(logits, ids, top_k, renormalize):
    w = torch.softmax(logits.float(), dim=-1).gather(-1, ids)
    return w / w.sum(-1, keepdim=True) if renormalize else w


def moe_experts_ref(x, weights, ids, gate_up, down):
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    x32 = x.float()
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        h = F.linear(silu_and_mul_ref(F.linear(x32[tok], gate_up[e].float())), down[e].float())
        out = out.index_add(0, tok, h * weights[tok, slot].float()[:, None])
    return out


def log_softmax_ref(logits):
    return torch.log_softmax(logits.float(), dim=-1)


# -- the generic Function -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Op:
    name: str
    kernel: Callable  # (provider, *tensors, **kw) -> Tensor | tuple
    reference: Callable | None = None  # (*tensors, *integer outputs, **kw) -> Tensor | tuple, differentiable
    backward: Callable | None = None  # (tensors, grads, kw) -> input grads (instead of the reference)


def _profiled(what: str):
    """A named range while torch's profiler runs (benchmarks break a step down per operator), else nothing."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.autograd.profiler.record_function(what)
    return nullcontext()


class KernelFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op: Op, provider, kw: dict, *tensors):
        ctx.op, ctx.kw, ctx.n_in = op, kw, len(tensors)
        ctx.guard = WeightGuard(tensors)
        with _profiled(f"tic.forward.{op.name}"):
            out = op.kernel(provider, *tensors, **kw)
        outs = out if isinstance(out, tuple) else (out,)
        fixed = [o for o in outs if not o.is_floating_point()]
        if fixed:
            ctx.mark_non_differentiable(*fixed)
        ctx.save_for_backward(*tensors, *fixed)
        return out

    @staticmethod
    def backward(ctx, *grads):
        with _profiled(f"tic.backward.{ctx.op.name}"):
            return KernelFunction._backward(ctx, *grads)

    @staticmethod
    def _backward(ctx, *grads):
        op = ctx.op
        for _, before in _FAULTS.get(op.name, []):
            if before is not None:
                with torch.no_grad():
                    before(ctx.guard.weights)
        ctx.guard.check(op.name)
        saved = ctx.saved_tensors
        tensors, fixed = saved[:ctx.n_in], saved[ctx.n_in:]
        needs = ctx.needs_input_grad[3:]
        if op.backward is not None:
            out = tuple(op.backward(tensors, grads, ctx.kw, needs))
        else:
            out = _reference_grads(op, tensors, fixed, grads, ctx.kw, needs)
        for fault, _ in _FAULTS.get(op.name, []):
            if fault is not None:
                out = tuple(fault(out))
        return (None, None, None, *out)


def _reference_grads(op, tensors, fixed, grads, kw, needs) -> tuple:
    with torch.enable_grad():
        inputs = [t.detach().requires_grad_(bool(n)) if isinstance(t, torch.Tensor) and t.is_floating_point()
                  else t for t, n in zip(tensors, needs)]
        ref = op.reference(*inputs, *fixed, **kw)
        refs = ref if isinstance(ref, tuple) else (ref,)
        pairs = [(r, g) for r, g in zip(refs, grads) if g is not None and r.requires_grad]
        wanted = [i for i, n in enumerate(needs) if n]
        if not pairs or not wanted:
            return tuple(None for _ in tensors)
        got = torch.autograd.grad([r for r, _ in pairs], [inputs[i] for i in wanted],
                                  [g.to(r.dtype) for r, g in pairs], allow_unused=True)
    out = [None] * len(tensors)
    for i, g in zip(wanted, got):
        out[i] = g
    return tuple(out)


def _linear_kernel(provider, x, *wb, n):
    w = wb[0] if n == 1 else torch.cat(wb[:n])
    biases = wb[n:]
    b = None if biases[0] is None else (biases[0] if n == 1 else torch.cat(biases))
    return provider.linear(x, w, b)


def _linear_backward(tensors, grads, kw, needs):
    n = kw["n"]
    x, ws, bs = tensors[0], tensors[1:1 + n], tensors[1 + n:]
    g = grads[0]
    w = ws[0] if n == 1 else torch.cat(ws)
    g2 = g.reshape(-1, g.shape[-1])
    gx = torch.matmul(g, w.to(g.dtype)) if needs[0] else None
    gw = torch.matmul(g2.t(), x.reshape(-1, x.shape[-1]).to(g.dtype)) if any(needs[1:1 + n]) else None
    gb = g2.sum(0) if any(needs[1 + n:]) else None
    sizes = [t.shape[0] for t in ws]
    gws = gw.split(sizes) if gw is not None else [None] * n
    gbs = gb.split(sizes) if gb is not None else [None] * n
    return (gx, *[gi.to(wi.dtype) if gi is not None else None for gi, wi in zip(gws, ws)],
            *[gi.to(bi.dtype) if gi is not None and bi is not None else None for gi, bi in zip(gbs, bs)])


OPS: dict[str, Op] = {op.name: op for op in [
    Op("linear", _linear_kernel, backward=_linear_backward),
    Op("rms_norm", lambda p, x, w, eps: p.rms_norm(x, w, eps), rms_norm_ref),
    Op("add_rms_norm", lambda p, x, r, w, eps: p.add_rms_norm(x, r, w, eps), add_rms_norm_ref),
    Op("rotary", lambda p, q, k, pos, cs: p.rotary(q, k, pos, cs), rotary_ref),
    Op("silu_and_mul", lambda p, x: p.silu_and_mul(x), silu_and_mul_ref),
    Op("attention", lambda p, q, k, v, mask, scale: p.attention(q, k, v, mask, scale), attention_ref),
    Op("moe_route", lambda p, logits, top_k, renormalize: p.moe_route(logits, top_k, renormalize),
       moe_route_ref),
    Op("moe_experts", lambda p, x, w, ids, gu, d: p.moe_experts(x, w, ids, gu, d), moe_experts_ref),
    Op("log_softmax", lambda p, logits: p.log_softmax(logits), log_softmax_ref),
]}


class Ops:
    """The wrappers bound to one provider: what the patched model modules call."""

    def __init__(self, provider):
        self.provider = provider

    def _run(self, name, *tensors, **kw):
        return KernelFunction.apply(OPS[name], self.provider, kw, *tensors)

    def linear(self, x, weights: list, biases: list | None = None):
        biases = biases if biases is not None and biases[0] is not None else [None] * len(weights)
        return self._run("linear", x, *weights, *biases, n=len(weights))

    def rms_norm(self, x, w, eps):
        return self._run("rms_norm", x, w, eps=eps)

    def add_rms_norm(self, x, residual, w, eps):
        return self._run("add_rms_norm", x, residual, w, eps=eps)

    def rotary(self, q, k, positions, cos_sin):
        return self._run("rotary", q, k, positions, cos_sin)

    def silu_and_mul(self, x):
        return self._run("silu_and_mul", x)

    def attention(self, q, k, v, mask, scale):
        return self._run("attention", q, k, v, mask, scale=scale)

    def moe_route(self, logits, top_k, renormalize):
        return self._run("moe_route", logits, top_k=top_k, renormalize=renormalize)

    def moe_experts(self, x, weights, ids, gate_up, down):
        return self._run("moe_experts", x, weights, ids, gate_up, down)

    def log_softmax(self, logits):
        return self._run("log_softmax", logits)
