"""Autograd wrappers: forward values from a kernel provider, backward from a plain PyTorch reference.

The inference kernels define the values and training adds the backward (method 3.1). Each operator below is
one `autograd.Function`: forward calls the provider's kernel (the very kernel the rollout runs) and returns
its output unchanged; backward is the gradient of a plain PyTorch reference of the same operator (`*_ref`,
float32 or wider, on the inputs saved at forward; quantization and rounding treated as identity: a
straight-through estimator). Every operator has that gradient written out in closed form (a few fused passes,
GEMMs in the model dtype as a plain training step runs them, elementwise math in float32), so a backward
builds no autograd graph; tests compare each with autograd through its reference. Attention's backward is
torch's SDPA backward on the saved inputs. An operator whose written-out backward does not cover a case
(a gradient for the rotary table) falls back to autograd through the reference.

Every backward first checks that no weight it saw at forward changed since (tensor version and storage): an
optimizer step or weight sync between forward and backward would otherwise mix weight versions silently.

Ops looks each operator up in its own table: a test plants a wrong backward (tic.harness.testing.backward_plants)
by installing, in one model's wrappers, an Ops whose table holds an Op of its own; no backward looks for plants.
C7 must catch such faults by measurement alone.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tic.config.schema import BackwardConfig
from tic.harness.kernels import routing as routing_mod
from tic.harness.kernels.memo import TensorMemo
from tic.harness.kernels.rope import rotate_interleaved, rotate_neox


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


# -- references: plain PyTorch, float32 (float64 stays float64: tests), differentiable ---------------------------
def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def rms_norm_ref(x, w, eps, offset=0.0):
    """(offset + w) * x_hat: offset 0 for Llama's norm, 1 for Gemma's (1 + w)."""
    x32 = _wide(x)
    return (_wide(w) + offset) * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def add_rms_norm_ref(x, residual, w, eps, offset=0.0):
    total = _wide(x) + _wide(residual)
    return rms_norm_ref(total, w, eps, offset), total


def rotary_ref(q, k, positions, cos_sin):
    c = _wide(cos_sin)
    return rotate_neox(_wide(q), positions, c), rotate_neox(_wide(k), positions, c)


def rotary_interleaved_ref(q, k, positions, cos_sin):
    c = _wide(cos_sin)
    return rotate_interleaved(_wide(q), positions, c), rotate_interleaved(_wide(k), positions, c)


def silu_and_mul_ref(x):
    g, u = _wide(x).chunk(2, dim=-1)
    return F.silu(g) * u


def gelu_tanh_and_mul_ref(x):
    g, u = _wide(x).chunk(2, dim=-1)
    return F.gelu(g, approximate="tanh") * u


def softcap_ref(x, cap):
    return torch.tanh(_wide(x) / cap) * cap


# relu2: relu then square, the product rounded once from the exact float square of a model-dtype value, as vLLM's
# _C.relu_squared computes it (widen, clamp at 0, square in float32, one rounding)
PLAIN_ACTS = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu, "silu": F.silu,
              "relu2": lambda x: F.relu(x).square()}


def activation_ref(x, kind):
    return PLAIN_ACTS[kind](_wide(x))


def _activation_input_grad(x, g, kind: str):
    """d/dx of gelu = Phi(x) + x phi(x); of gelu_tanh = 0.5 (1 + t) + 0.5 x (1 - t^2) u', t = tanh(u),
    u = c (x + 0.044715 x^3), u' = c (1 + 3 * 0.044715 x^2); of relu = [x > 0]; of relu2 = 2 relu(x); of
    silu = s (1 + x (1 - s))."""
    x = _wide(x)
    if kind == "gelu":
        d = 0.5 * (1 + torch.erf(x * 0.7071067811865476)) + x * torch.exp(-0.5 * x * x) * 0.3989422804014327
    elif kind == "gelu_tanh":
        c = 0.7978845608028654
        t = torch.tanh(c * (x + 0.044715 * x ** 3))
        d = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x)
    elif kind == "relu":
        d = (x > 0).to(x.dtype)
    elif kind == "relu2":
        d = 2 * F.relu(x)
    else:
        sg = torch.sigmoid(x)
        d = sg * (1 + x * (1 - sg))
    return g.to(x.dtype) * d


def _activation_backward(tensors, fixed, grads, kw, needs, run):
    if not needs[0] or grads[0] is None:
        return (None,)
    return (run.fused(_activation_input_grad, tensors[0], grads[0], kw["kind"]),)


def layer_norm_ref(x, w, b, eps):
    return F.layer_norm(_wide(x), (x.shape[-1],), None if w is None else _wide(w), None if b is None else _wide(b),
                        eps)


def layer_norm_float32_written_out(x, w, b, eps):
    """LayerNorm written out in float32, rounded once to x's dtype: (x - mean) * rsqrt(var + eps) * w (+ b), the
    mean and the variance of the centred values over the last dimension (transformers' CohereLayerNorm, vLLM's
    commandr layer_norm_func)."""
    h = x.to(torch.promote_types(x.dtype, torch.float32))  # float32, or wider for a float64 reference
    mean = h.mean(-1, keepdim=True)
    var = (h - mean).pow(2).mean(-1, keepdim=True)
    h = (h - mean) * torch.rsqrt(var + eps)
    h = (w.to(h.dtype) * h) if w is not None else h
    return (h + b.to(h.dtype) if b is not None else h).to(x.dtype)


def layer_norm_float32_ref(x, w, b, eps):
    return layer_norm_float32_written_out(_wide(x), None if w is None else _wide(w), None if b is None else _wide(b),
                                          eps)


def sigmoid_gate_ref(g, y):
    return torch.sigmoid(_wide(g)) * _wide(y)


# functions an attention applies to its gate linear's output before multiplying its attention output by it
OUTPUT_GATES = {"sigmoid": torch.sigmoid, "softplus": F.softplus}


def gate_output_ref(g, y, function: str, per_head: bool):
    """y [.., H*D] times OUTPUT_GATES[function](g), computed in float32 and rounded to y's dtype, the product in y's
    dtype: per element (g [.., H*D]) or one gate per head (g [.., H], each over its head's D features), as Laguna's
    and AFMoE's forwards gate their attention output. None where g's width fits neither."""
    gate = OUTPUT_GATES[function](g.to(torch.promote_types(g.dtype, torch.float32))).to(y.dtype)
    if not per_head:
        return y * gate if gate.shape == y.shape else None
    heads = gate.shape[-1]
    if heads == 0 or y.shape[-1] % heads:
        return None
    return (y.reshape(*y.shape[:-1], heads, -1) * gate[..., None]).reshape(y.shape)


def output_gate_ref(g, y, function: str, per_head: bool):
    return gate_output_ref(_wide(g), _wide(y), function, per_head)


def attention_ref(q, k, v, mask, scale, softcap=None, window=None):
    """q [B, H, Q, D], k/v [B, Hkv, K, D], mask bool [B, 1, Q, K] or None (causal, within `window` keys when
    given) -> [B, Q, H, D]. torch's SDPA in float32 (its fused backward on GPU); with a softcap the scores
    cap * tanh(s / cap) written out. A query that sees no key (padding) gives 0."""
    rep = q.shape[1] // k.shape[1]
    k, v = _wide(k).repeat_interleave(rep, dim=1), _wide(v).repeat_interleave(rep, dim=1)
    safe, seen = _sdpa_mask(mask, q.shape[2], k.shape[2], q.device, window)
    if softcap is None:
        out = F.scaled_dot_product_attention(_wide(q), k, v, attn_mask=safe, scale=scale)
    else:
        scores = softcap_ref(torch.matmul(_wide(q), k.transpose(-1, -2)) * scale, softcap)
        out = torch.matmul(torch.softmax(scores.masked_fill(~safe, float("-inf")), dim=-1), v)
    return torch.where(seen, out, torch.zeros((), device=q.device)).transpose(1, 2)


def attention_sinks_ref(q, k, v, mask, sinks, scale, softcap=None, window=None):
    """attention_ref with a learned logit per head beside every row's keys (GPT-OSS's attention sinks): the softmax
    runs over the keys and that logit, and the logit's share is dropped. Written out in float32."""
    rep = q.shape[1] // k.shape[1]
    k, v = _wide(k).repeat_interleave(rep, dim=1), _wide(v).repeat_interleave(rep, dim=1)
    safe, seen = _sdpa_mask(mask, q.shape[2], k.shape[2], q.device, window)
    scores = torch.matmul(_wide(q), k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap_ref(scores, softcap)
    sink = _wide(sinks).reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    probs = torch.softmax(torch.cat([scores.masked_fill(~safe, float("-inf")), sink], dim=-1), dim=-1)[..., :-1]
    return torch.where(seen, torch.matmul(probs, v), torch.zeros((), device=q.device)).transpose(1, 2)


def _sdpa_mask(mask, Q: int, K: int, device, window=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the bool mask SDPA runs, which query rows see any key) for a mask [B, 1, Q, K] or None (causal,
    bottom-right aligned, the last `window` keys when given). A fully masked row would give NaN: it is let see
    key 0, and the caller zeroes it."""
    if mask is None:
        mask = torch.ones(Q, K, dtype=torch.bool, device=device).tril(K - Q)
        if window:
            mask = mask & ~torch.ones(Q, K, dtype=torch.bool, device=device).tril(K - Q - window)
        mask = mask[None, None]
    seen = mask.any(-1, keepdim=True)
    first = torch.arange(K, device=device) == 0
    return mask | (~seen & first), seen


def moe_route_ref(logits, ids, top_k, routing, bias=None):
    """The weights at the chosen ids, in float64 where the kernel ran float32 (the ids are the kernel's)."""
    return routing_mod.weights(routing_mod.scores(_wide(logits), routing), ids, routing)


def moe_experts_ref(x, weights, ids, gate_up, down):
    x32 = _wide(x)
    out = torch.zeros(x.shape, dtype=x32.dtype, device=x.device)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        h = F.linear(silu_and_mul_ref(F.linear(x32[tok], _wide(gate_up[e]))), _wide(down[e]))
        out = out.index_add(0, tok, h * _wide(weights[tok, slot])[:, None])
    return out


def log_softmax_ref(logits):
    return torch.log_softmax(_wide(logits), dim=-1)


# -- how one model's written-out backwards run -----------------------------------------------------------------
@functools.cache
def _compiled(fn: Callable) -> Callable:
    """fn compiled by torch.compile, built once per function in this process (the compiled code depends on fn
    alone, as torch's own caches do); whether it runs is each Backward's choice. In Inductor's deterministic mode:
    otherwise Inductor times a reduction's candidate kernels in each process and keeps the fastest, their sum
    orders differ, and the same backward gives other bits after a restart (C9's restored update differed from the
    uninterrupted one). A torch whose Inductor lacks that mode raises here, and the closed form runs eagerly."""
    import torch._inductor.config as inductor

    if not hasattr(inductor, "deterministic"):
        raise RuntimeError("this torch's Inductor has no deterministic mode (its kernels would be chosen by timing)")
    return torch.compile(fn, dynamic=True, options={"deterministic": True})


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


class Backward:
    """The written-out backwards of one wrapped model: its switches (tic.yaml train.backward) and what running them
    found out here. On CUDA each closed form runs compiled by torch.compile into a few fused kernels: eager runs
    one kernel per elementwise op, and at training sizes those launches, not the arithmetic, set the step time. On
    CPU, with fuse off, or once compiling it failed here (the reason kept in compile_errors): the same function,
    eager. The MoE experts' GEMMs run as torch's grouped GEMM where it takes the operands until a launch fails
    here (grouped_mm_errors), then one GEMM per expert. Either way a surrogate: C7 judges its gradients with a
    tolerance."""

    def __init__(self, options: BackwardConfig | None = None):
        self.options = options if options is not None else BackwardConfig()
        self.compile_errors: dict[str, str] = {}  # closed forms that could not be compiled here, and why
        self.grouped_mm_errors: list[str] = []  # why torch's grouped GEMM failed here
        # which mask rows are causal, read once per mask: every layer of one backward passes the same one
        self.causal_rows = TensorMemo(_causal_rows)

    def fused(self, fn: Callable, *args):
        """fn(*args), compiled on CUDA unless fuse is off or compiling fn failed here."""
        first = next(a for a in args if isinstance(a, torch.Tensor))
        if not first.is_cuda or not self.options.fuse or fn.__name__ in self.compile_errors:
            return fn(*args)
        try:
            return _compiled(fn)(*args)
        except Exception as e:  # noqa: BLE001 - a compiler failure leaves the eager function, which is correct
            self.compile_errors[fn.__name__] = _first_line(e)
            return fn(*args)

    def grouped_mm(self, *tensors: torch.Tensor) -> bool:
        """Whether the experts' GEMMs run as torch's grouped GEMM (`torch._grouped_mm`, one launch for all experts):
        it takes bfloat16 operands; elsewhere (float32/64 models, a torch without it, grouped_mm off, or once a
        launch failed here) they run one by one."""
        return (self.options.grouped_mm and not self.grouped_mm_errors and hasattr(torch, "_grouped_mm")
                and all(t.dtype == torch.bfloat16 for t in tensors))


# -- the generic Function -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Op:
    name: str
    kernel: Callable  # (provider, *tensors, **kw) -> Tensor | tuple
    reference: Callable | None = None  # (*tensors, *integer outputs, **kw) -> Tensor | tuple, differentiable
    # (tensors, integer outputs, grads, kw, needs, the model's Backward) -> input grads: the reference's gradient
    # written out; it may return None for a case it does not cover, and autograd through the reference runs instead
    backward: Callable | None = None

    def input_grads(self, ctx, grads: tuple) -> tuple:
        """One backward call's input gradients (ctx: what KernelFunction.forward kept): the weight check, then the
        written-out gradient, or autograd through the reference where that does not cover the case."""
        ctx.guard.check(self.name)
        saved = ctx.saved_tensors
        tensors, fixed = saved[:ctx.n_in], saved[ctx.n_in:]
        needs = ctx.needs_input_grad[3:]
        out = self.backward(tensors, fixed, grads, ctx.kw, needs, ctx.run) if self.backward is not None else None
        return tuple(out) if out is not None else _reference_grads(self, tensors, fixed, grads, ctx.kw, needs)


def _profiled(what: str):
    """A named range while torch's profiler runs (benchmarks break a step down per operator), else nothing."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.autograd.profiler.record_function(what)
    return nullcontext()


class KernelFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op: Op, ops: "Ops", kw: dict, *tensors):
        ctx.op, ctx.run, ctx.kw, ctx.n_in = op, ops.backward, kw, len(tensors)
        ctx.guard = WeightGuard(tensors)
        with _profiled(f"tic.forward.{op.name}"):
            out = op.kernel(ops.provider, *tensors, **kw)
        outs = out if isinstance(out, tuple) else (out,)
        fixed = [o for o in outs if not o.is_floating_point()]
        if fixed:
            ctx.mark_non_differentiable(*fixed)
        ctx.save_for_backward(*tensors, *fixed)
        return out

    @staticmethod
    def backward(ctx, *grads):
        with _profiled(f"tic.backward.{ctx.op.name}"):
            return (None, None, None, *ctx.op.input_grads(ctx, grads))


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


def _linear_backward(tensors, fixed, grads, kw, needs, run):
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

# -- written-out gradients of the references ------------------------------------------------------------------
# Each returns the gradient autograd would give through the matching *_ref (tests/test_backward_closed_form.py
# checks that in float64). Elementwise math runs in float32 (or wider); GEMMs run in the model dtype. The
# elementwise ones run through the model's Backward.fused (compiled on CUDA).
def _rms_norm_input_grads(x, w, g, eps, need_x: bool, need_w: bool, offset: float = 0.0):
    """y = (offset + w) * x * r, r = (mean(x^2) + eps)^-1/2: gx = r * (g w' - n * mean(g w' n)), n = x r,
    w' = offset + w; gw = sum g n."""
    x32 = _wide(x)
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    n = x32 * r
    g32 = g.to(x32.dtype)
    gw = (g32 * n).reshape(-1, n.shape[-1]).sum(0) if need_w else None
    gx = None
    if need_x:
        gn = g32 * (_wide(w) + offset)
        gx = r * (gn - n * (gn * n).mean(-1, keepdim=True))
    return gx, gw


def _layer_norm_input_grads(x, w, g, eps, need_x: bool, need_w: bool, need_b: bool):
    """y = w * n + b, n = (x - mean(x)) * r, r = (var(x) + eps)^-1/2 (biased var): gx = r * (gn - mean(gn) -
    n * mean(gn n)), gn = g w; gw = sum g n; gb = sum g."""
    x32 = _wide(x)
    mu = x32.mean(-1, keepdim=True)
    r = torch.rsqrt((x32 - mu).pow(2).mean(-1, keepdim=True) + eps)
    n = (x32 - mu) * r
    g32 = g.to(x32.dtype)
    flat = lambda t: t.reshape(-1, t.shape[-1]).sum(0)  # noqa: E731
    gw = flat(g32 * n) if need_w else None
    gb = flat(g32) if need_b else None
    gx = None
    if need_x:
        gn = g32 * _wide(w) if w is not None else g32
        gx = r * (gn - gn.mean(-1, keepdim=True) - n * (gn * n).mean(-1, keepdim=True))
    return gx, gw, gb


def _layer_norm_backward(tensors, fixed, grads, kw, needs, run):
    x, w, b = tensors
    return run.fused(_layer_norm_input_grads, x, w, grads[0], kw["eps"], needs[0], w is not None and needs[1],
                     b is not None and needs[2])


def _sigmoid_gate_input_grads(g, y, grad, need_g: bool, need_y: bool):
    """out = s * y, s = sigmoid(g) (g [T, 1] broadcast over y's features): gg = sum(grad y) s (1 - s), gy = grad s."""
    s = torch.sigmoid(_wide(g))
    grad32 = grad.to(s.dtype)
    gg = (grad32 * _wide(y)).sum(-1, keepdim=True) * s * (1 - s) if need_g else None
    gy = grad32 * s if need_y else None
    return gg, gy


def _sigmoid_gate_backward(tensors, fixed, grads, kw, needs, run):
    if grads[0] is None:
        return (None, None)
    return run.fused(_sigmoid_gate_input_grads, tensors[0], tensors[1], grads[0], needs[0], needs[1])


def _output_gate_input_grads(g, y, grad, function: str, per_head: bool, need_g: bool, need_y: bool):
    """out = y * f(g), f(g) per feature or broadcast over each head's features: gy = grad f(g), gg = (grad y,
    summed over a head's features where one gate serves them) f'(g); sigmoid' = s (1 - s), softplus' = sigmoid."""
    g32, y32 = _wide(g), _wide(y)
    grad32 = grad.to(g32.dtype)
    s = torch.sigmoid(g32)
    gate, slope = (s, s * (1 - s)) if function == "sigmoid" else (F.softplus(g32), s)
    if per_head:
        heads = g.shape[-1]
        gy = (grad32.reshape(*grad.shape[:-1], heads, -1) * gate[..., None]).reshape(grad.shape) if need_y else None
        gg = (grad32 * y32).reshape(*grad.shape[:-1], heads, -1).sum(-1) * slope if need_g else None
    else:
        gy = grad32 * gate if need_y else None
        gg = grad32 * y32 * slope if need_g else None
    return gg, gy


def _output_gate_backward(tensors, fixed, grads, kw, needs, run):
    if grads[0] is None:
        return (None, None)
    return run.fused(_output_gate_input_grads, tensors[0], tensors[1], grads[0], kw["function"], kw["per_head"],
                     needs[0], needs[1])


def _rms_norm_backward(tensors, fixed, grads, kw, needs, run):
    x, w = tensors
    return run.fused(_rms_norm_input_grads, x, w, grads[0], kw["eps"], needs[0], needs[1], kw.get("offset", 0.0))


def _add_rms_norm_input_grads(x, residual, w, g_norm, g_total, eps, need_x: bool, need_w: bool,
                              offset: float = 0.0):
    """The norm's gradients at x + residual, plus the gradient of the sum output: one compiled function (on the
    GPU), not the sum, the norm backward and the add launched one by one."""
    gt, gw = _rms_norm_input_grads(_wide(x) + _wide(residual), w, g_norm, eps, need_x, need_w, offset)
    if g_total is not None and gt is not None:
        gt = gt + g_total
    return gt, gw


def _add_rms_norm_backward(tensors, fixed, grads, kw, needs, run):
    x, residual, w = tensors
    g_norm, g_total = grads
    gt, gw = None, None
    if g_norm is not None:
        gt, gw = run.fused(_add_rms_norm_input_grads, x, residual, w, g_norm, g_total, kw["eps"],
                           needs[0] or needs[1], needs[2], kw.get("offset", 0.0))
    elif g_total is not None:
        gt = _wide(g_total)
    return (gt if needs[0] else None), (gt if needs[1] else None), gw


def _silu_and_mul_input_grad(x, g):
    a, b = _wide(x).chunk(2, dim=-1)
    g = g.to(a.dtype)
    return torch.cat([torch.ops.aten.silu_backward(g * b, a), g * F.silu(a)], dim=-1)


def _silu_and_mul_backward(tensors, fixed, grads, kw, needs, run):
    if not needs[0]:
        return (None,)
    return (run.fused(_silu_and_mul_input_grad, tensors[0], grads[0]),)


def _gelu_tanh_and_mul_input_grad(x, g):
    a, b = _wide(x).chunk(2, dim=-1)
    g = g.to(a.dtype)
    return torch.cat([torch.ops.aten.gelu_backward(g * b, a, approximate="tanh"),
                      g * F.gelu(a, approximate="tanh")], dim=-1)


def _gelu_tanh_and_mul_backward(tensors, fixed, grads, kw, needs, run):
    if not needs[0]:
        return (None,)
    return (run.fused(_gelu_tanh_and_mul_input_grad, tensors[0], grads[0]),)


def _softcap_input_grad(x, g, cap: float):
    t = torch.tanh(_wide(x) / cap)
    return g.to(t.dtype) * (1 - t * t)


def _softcap_backward(tensors, fixed, grads, kw, needs, run):
    if not needs[0] or grads[0] is None:
        return (None,)
    return (run.fused(_softcap_input_grad, tensors[0], grads[0], kw["cap"]),)


def _rotate_neox_input_grad(g, positions, cos_sin):
    """Transpose of rotate_neox: out1 = x1 c - x2 s, out2 = x2 c + x1 s, so gx1 = g1 c + g2 s, gx2 = g2 c - g1 s."""
    g32 = _wide(g)
    rot = cos_sin.shape[-1]
    cos, sin = _wide(cos_sin)[positions].to(g32.dtype).chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    g1, g2 = g32[..., :rot].chunk(2, dim=-1)
    out = torch.cat([g1 * cos + g2 * sin, g2 * cos - g1 * sin], dim=-1)
    return torch.cat([out, g32[..., rot:]], dim=-1) if g32.shape[-1] > rot else out


def _rotate_interleaved_input_grad(g, positions, cos_sin):
    """Transpose of rotate_interleaved: per pair out0 = x0 c - x1 s, out1 = x1 c + x0 s, so gx0 = g0 c + g1 s,
    gx1 = g1 c - g0 s."""
    g32 = _wide(g)
    rot = cos_sin.shape[-1]
    cos, sin = _wide(cos_sin)[positions].to(g32.dtype).chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    g0, g1 = g32[..., 0:rot:2], g32[..., 1:rot:2]
    out = torch.stack((g0 * cos + g1 * sin, g1 * cos - g0 * sin), dim=-1).flatten(-2)
    return torch.cat([out, g32[..., rot:]], dim=-1) if g32.shape[-1] > rot else out


def _rotary_backward_of(input_grad):
    def backward(tensors, fixed, grads, kw, needs, run):
        if needs[3]:
            return None  # a trainable rotary table: autograd through the reference
        q, k, positions, cos_sin = tensors
        gq = run.fused(input_grad, grads[0], positions, cos_sin) if needs[0] and grads[0] is not None else None
        gk = run.fused(input_grad, grads[1], positions, cos_sin) if needs[1] and grads[1] is not None else None
        return gq, gk, None, None
    return backward


_rotary_backward = _rotary_backward_of(_rotate_neox_input_grad)
_rotary_interleaved_backward = _rotary_backward_of(_rotate_interleaved_input_grad)


def _causal_rows(mask: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Which query rows of a bool mask [B, 1, Q, K] see exactly keys 0..q, [B, Q], and whether all do."""
    Q, K = mask.shape[-2:]
    tril = torch.ones(Q, K, dtype=torch.bool, device=mask.device).tril()
    rows = (mask[:, 0] == tril).all(-1)
    return rows, bool(rows.all())


def _attention_sinks_backward(tensors, fixed, grads, kw, needs, run):
    """attention_sinks_ref's gradient written out in float32: with P the softmax over a row's keys and its head's
    sink, dP = dO V^T on the keys (the sink's share feeds no output), dS = P (dP - sum(P dP)), the sink's gradient
    -P_sink sum(P dP) summed over every row of its head; K/V heads' gradients summed over the query heads sharing
    them. A softcap is left to autograd through the reference."""
    q, k, v, mask, sinks = tensors
    g = grads[0]
    if g is None or not any(needs[:3]) and not needs[4]:
        return None, None, None, None, None
    if kw.get("softcap") is not None:
        return None
    B, H, Q, D = q.shape
    Hkv, K = k.shape[1], k.shape[2]
    rep = H // Hkv
    q32, k32, v32 = _wide(q), _wide(k).repeat_interleave(rep, dim=1), _wide(v).repeat_interleave(rep, dim=1)
    safe, seen = _sdpa_mask(mask, Q, K, q.device, kw.get("window"))
    scores = (torch.matmul(q32, k32.transpose(-1, -2)) * kw["scale"]).masked_fill(~safe, float("-inf"))
    sink = _wide(sinks).reshape(1, -1, 1, 1).expand(B, H, Q, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)
    p, p_sink = probs[..., :-1], probs[..., -1:]
    go = _wide(g).transpose(1, 2) * seen  # rows that see no key output 0 in the reference
    dp = torch.matmul(go, v32.transpose(-1, -2))
    share = (p * dp).sum(-1, keepdim=True)
    ds = p * (dp - share) * kw["scale"]
    dq = torch.matmul(ds, k32)
    dk = torch.matmul(ds.transpose(-1, -2), q32).reshape(B, Hkv, rep, K, D).sum(2)
    dv = torch.matmul(p.transpose(-1, -2), go).reshape(B, Hkv, rep, K, -1).sum(2)
    dsink = (-p_sink * share).sum(dim=(0, 2, 3))
    pick = lambda t, ref, n: t.to(ref.dtype) if n else None  # noqa: E731
    return pick(dq, q, needs[0]), pick(dk, k, needs[1]), pick(dv, v, needs[2]), None, pick(dsink, sinks, needs[4])


def _attention_backward(tensors, fixed, grads, kw, needs, run):
    """attention_ref's gradient through torch's SDPA backward in the inputs' dtype, K/V heads shared by
    enable_gqa. With the causal flag (no materialised mask, the fused kernels) when every query row whose
    output gradient is non-zero sees exactly keys 0..q: a right-padded batch, where only padding rows see
    otherwise and the loss gives them no gradient; else with the bool mask, fully masked rows' gradient zeroed
    (their output is 0 in the reference)."""
    q, k, v, mask = tensors
    g = grads[0]
    if g is None or not any(needs[:3]):
        return None, None, None, None
    if kw.get("softcap") is not None or (kw.get("window") and mask is None):
        return None  # SDPA has no softcap and no window flag: autograd through the reference
    B, H, Q, D = q.shape
    K = k.shape[2]
    go = g.transpose(1, 2).to(q.dtype)  # [B, H, Q, Dv]
    causal = Q == K
    if causal and mask is not None:
        rows, all_causal = run.causal_rows.get(mask)
        # one device sync; only for masks with non-causal rows (padding)
        causal = all_causal or not bool(((go != 0).any(-1).any(1) & ~rows).any())
    sdpa_kw = dict(scale=kw["scale"], enable_gqa=k.shape[1] != H)
    if causal:
        sdpa_kw["is_causal"] = True
    else:
        sdpa_kw["attn_mask"], seen = _sdpa_mask(mask, Q, K, q.device)
        go = go * seen.to(go.dtype)
    def sdpa_grads(deterministic: bool):
        with torch.enable_grad(), _deterministic_flash(deterministic):
            ins = [t.detach().requires_grad_(bool(n)) for t, n in zip((q, k, v), needs[:3])]
            out = F.scaled_dot_product_attention(*ins, **sdpa_kw)
            return ins, iter(torch.autograd.grad(out, [t for t in ins if t.requires_grad], go))

    flash = causal and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and D <= 256
    try:
        ins, got = sdpa_grads(flash)
    except RuntimeError:
        if not flash:
            raise
        ins, got = sdpa_grads(False)  # no flash kernel for this problem: torch's own choice of kernel
    return (*[next(got) if t.requires_grad else None for t in ins], None)


@contextmanager
def _deterministic_flash(on: bool):
    """FlashAttention's backward on the GPU sums dQ over key blocks with atomic adds unless torch's deterministic
    mode is on: two runs of one training step (C9's restore in a fresh process) then update the weights by other
    bits. Only a causal bf16/fp16 SDPA call runs inside, held to the flash kernel (no cuBLAS, which deterministic
    mode would refuse without a workspace setting)."""
    if not on:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)


def _moe_route_backward(tensors, fixed, grads, kw, needs, run):
    """w = scale * score(logits)[ids] (/ sum): back through the scale and renormalisation, scatter to the
    experts, then the softmax or sigmoid; the ids (and the selection bias that chose them) take none."""
    if not needs[0] or grads[0] is None:
        return (None,)
    return (routing_mod.weights_backward(_wide(tensors[0]), fixed[0], grads[0], kw["routing"]),)


def _log_softmax_backward(tensors, fixed, grads, kw, needs, run):
    if not needs[0]:
        return (None,)
    logits = tensors[0]
    wide = torch.promote_types(logits.dtype, torch.float32)
    out = torch.log_softmax(logits, dim=-1, dtype=wide)  # upcast fused into the pass, as the reference's value
    return (torch._log_softmax_backward_data(grads[0].to(wide), out, -1, wide),)  # g - exp(out) * sum(g)


class _ExpertGemms:
    """The per-expert GEMMs of the experts' backward over pairs grouped by expert (`counts` pairs each, in expert
    order): `rows(a, w)` = a[pairs of e] @ w[e] into one [P, N] buffer; `weights(a, b)` = a[pairs of e].T @
    b[pairs of e] for every expert, [E, A, B] (zero for an expert without pairs). One grouped launch each where
    torch's grouped GEMM runs (bf16), else one GEMM per expert with pairs (which needs the counts on the host:
    one device read). Either is a surrogate's GEMM in the model dtype: C7 judges the result. A grouped launch that
    fails goes into `errors` (the model's Backward.grouped_mm_errors), and the loop runs from then on."""

    def __init__(self, counts: torch.Tensor, grouped: bool, errors: list[str]):
        self.counts, self.grouped, self.errors, self._spans = counts, grouped, errors, None
        if self.grouped:
            self.offs = torch.cumsum(counts, 0).to(torch.int32)

    @property
    def spans(self) -> list[tuple[int, int, int]]:
        if self._spans is None:
            self._spans, start = [], 0
            for e, n in enumerate(self.counts.tolist()):
                if n:
                    self._spans.append((e, start, start + n))
                start += n
        return self._spans

    def _grouped(self, fn):
        try:
            return fn()
        except (RuntimeError, NotImplementedError) as e:  # a layout or device this torch does not group: loop
            self.errors.append(_first_line(e))
            self.grouped = False
            return None

    def rows(self, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.grouped:
            out = self._grouped(lambda: torch._grouped_mm(a, w, offs=self.offs))
            if out is not None:
                return out
        out = a.new_empty(a.shape[0], w.shape[-1])
        for e, lo, hi in self.spans:
            torch.mm(a[lo:hi], w[e], out=out[lo:hi])
        return out

    def weights(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self.grouped:  # groups along the reduced dimension; an empty group's block is not written everywhere
            out = self._grouped(lambda: torch._grouped_mm(a.t(), b, offs=self.offs))
            if out is not None:
                return torch.where((self.counts > 0)[:, None, None], out, 0)
        out = a.new_zeros(self.counts.shape[0], a.shape[1], b.shape[1])
        for e, lo, hi in self.spans:
            torch.mm(a[lo:hi].t(), b[lo:hi], out=out[e])
        return out


def _moe_experts_backward(tensors, fixed, grads, kw, needs, run):
    """moe_experts_ref's gradient over the (token, slot) pairs sorted by expert once: per expert only its GEMMs
    (model dtype: recompute gate_up -> down, then the gradient GEMMs; one grouped launch each in bf16), each
    writing its rows of one buffer; gathers, silu * mul and its derivative, the routing-weight dot products and
    the scatter back to tokens run once over all pairs (elementwise math and the sums over slots in float32)."""
    x, weights, ids, gate_up, down = tensors
    g = grads[0]
    if g is None:
        return None, None, None, None, None
    T, k = ids.shape
    H, dt = x.shape[-1], x.dtype
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pair index t * k + slot, grouped by expert
    gu_w, down_w = (w if w.dtype == dt else w.to(dt) for w in (gate_up, down))
    gemms = _ExpertGemms(torch.bincount(flat, minlength=gate_up.shape[0]), run.grouped_mm(x, gu_w, down_w),
                         run.grouped_mm_errors)
    tok = order // k
    xs, gs = x[tok], g.to(dt)[tok]  # [P, H] in expert order
    act = gemms.rows(xs, gu_w.transpose(1, 2))
    a1, a2 = _wide(act).chunk(2, dim=-1)
    silu = F.silu(a1)
    h = (silu * a2).to(dt)
    gx = gw = g_gate_up = g_down = None
    if needs[1]:
        y = gemms.rows(h, down_w.transpose(1, 2))
        gw = torch.zeros(T * k, dtype=a1.dtype, device=x.device)
        gw[order] = (_wide(gs) * _wide(y)).sum(-1)
        gw = gw.reshape(T, k)
    gy = (_wide(gs) * _wide(weights).reshape(-1)[order, None]).to(dt)
    if needs[4]:
        g_down = gemms.weights(gy, h).to(down.dtype)
    if needs[0] or needs[3]:
        gh = _wide(gemms.rows(gy, down_w))
        ga = _silu_and_mul_input_grad(act, gh).to(dt)  # silu * mul's own backward, eager
        if needs[3]:
            g_gate_up = gemms.weights(ga, xs).to(gate_up.dtype)
        if needs[0]:
            gxs = gemms.rows(ga, gu_w)
            gx = torch.zeros(x.shape, dtype=a1.dtype, device=x.device).index_add_(0, tok, _wide(gxs))
    return gx, gw, None, g_gate_up, g_down


def _offset(offset: float) -> dict:
    """A norm's weight offset as a keyword only when there is one: providers (and planted ones) that know only
    w * x_hat keep their signature."""
    return {"offset": offset} if offset else {}


def _attention_options(softcap, window) -> dict:
    return {k: v for k, v in (("softcap", softcap), ("window", window)) if v}


OPS: dict[str, Op] = {op.name: op for op in [
    Op("linear", _linear_kernel, backward=_linear_backward),
    Op("rms_norm", lambda p, x, w, eps, offset=0.0: p.rms_norm(x, w, eps, **_offset(offset)), rms_norm_ref,
       _rms_norm_backward),
    Op("add_rms_norm", lambda p, x, r, w, eps, offset=0.0: p.add_rms_norm(x, r, w, eps, **_offset(offset)),
       add_rms_norm_ref, _add_rms_norm_backward),
    Op("rotary", lambda p, q, k, pos, cs: p.rotary(q, k, pos, cs), rotary_ref, _rotary_backward),
    Op("rotary_interleaved", lambda p, q, k, pos, cs: p.rotary_interleaved(q, k, pos, cs), rotary_interleaved_ref,
       _rotary_interleaved_backward),
    Op("silu_and_mul", lambda p, x: p.silu_and_mul(x), silu_and_mul_ref, _silu_and_mul_backward),
    Op("gelu_tanh_and_mul", lambda p, x: p.gelu_tanh_and_mul(x), gelu_tanh_and_mul_ref,
       _gelu_tanh_and_mul_backward),
    Op("softcap", lambda p, x, cap: p.softcap(x, cap), softcap_ref, _softcap_backward),
    Op("sigmoid_gate", lambda p, g, y: p.sigmoid_gate(g, y), sigmoid_gate_ref, _sigmoid_gate_backward),
    Op("output_gate", lambda p, g, y, function, per_head: p.output_gate(g, y, function, per_head), output_gate_ref,
       _output_gate_backward),
    Op("layer_norm", lambda p, x, w, b, eps: p.layer_norm(x, w, b, eps), layer_norm_ref, _layer_norm_backward),
    Op("layer_norm_float32", lambda p, x, w, b, eps: p.layer_norm_float32(x, w, b, eps), layer_norm_float32_ref,
       _layer_norm_backward),
    Op("activation", lambda p, x, kind: p.activation(x, kind), activation_ref, _activation_backward),
    Op("attention", lambda p, q, k, v, mask, scale, softcap=None, window=None:
       p.attention(q, k, v, mask, scale, **_attention_options(softcap, window)), attention_ref, _attention_backward),
    # attention sinks: the sinks are parameters, trained too
    Op("attention_sinks", lambda p, q, k, v, mask, sinks, scale, softcap=None, window=None:
       p.attention(q, k, v, mask, scale, sinks=sinks, **_attention_options(softcap, window)), attention_sinks_ref,
       _attention_sinks_backward),
    Op("moe_route", lambda p, logits, top_k, routing, bias=None: p.moe_route(logits, top_k, routing, bias),
       moe_route_ref, _moe_route_backward),
    Op("moe_experts", lambda p, x, w, ids, gu, d: p.moe_experts(x, w, ids, gu, d), moe_experts_ref,
       _moe_experts_backward),
    Op("log_softmax", lambda p, logits: p.log_softmax(logits), log_softmax_ref, _log_softmax_backward),
]}


ATTENTION_INPUTS = "attention (q, k, v)"  # Ops.capture_inputs' key for the inputs of attention over an FP8 cache


class Ops:
    """The wrappers bound to one provider and one model's Backward, each operator looked up in `table` (OPS
    unless a test plants one of its own): what the patched model modules call."""

    def __init__(self, provider, backward: Backward | None = None, table: dict[str, Op] | None = None, quant=None):
        self.provider = provider
        self.backward = backward if backward is not None else Backward()
        self.table = table if table is not None else OPS
        self.quant = quant  # block-FP8 copies of a quantized model's weights (tic.harness.kernels.fp8), else None
        self.inputs: dict[str, list] | None = None  # while capture_inputs runs

    @property
    def rounds_kv_to_fp8(self) -> bool:
        """Whether attention reads K/V through an FP8 cache (the provider's kv_cache_dtype)."""
        return str(getattr(self.provider, "kv_cache_dtype", "auto")).startswith("fp8")

    @property
    def quantizes(self) -> bool:
        """Whether any operator rounds its inputs to FP8: block-FP8 weights or an FP8 KV cache."""
        return self.quant is not None or self.rounds_kv_to_fp8

    @contextmanager
    def capture_inputs(self):
        """Records what this model's FP8 steps round, in call order: by quantized parameter name the activation
        each block-FP8 operator quantizes, and under ATTENTION_INPUTS each attention call's (q, k, v) where K/V
        go through an FP8 cache. C2's stock model and C7's reference take them as their own rounding steps'
        inputs (as they take the path under test's expert routes): a rounding-level difference upstream would
        otherwise fall on another e4m3 code."""
        self.inputs = {}
        if self.quant is not None:
            self.quant.inputs = self.inputs
        try:
            yield self.inputs
        finally:
            self.inputs = None
            if self.quant is not None:
                self.quant.inputs = None

    def _run(self, name, *tensors, **kw):
        return KernelFunction.apply(self.table[name], self, kw, *tensors)

    def linear(self, x, weights: list, biases: list | None = None):
        biases = biases if biases is not None and biases[0] is not None else [None] * len(weights)
        if self.quant is not None and self.quant.covers(weights):  # block-FP8 weights: tic.harness.kernels.fp8
            return self._run("fp8_linear", x, *weights, *biases, n=len(weights), quant=self.quant)
        return self._run("linear", x, *weights, *biases, n=len(weights))

    def rms_norm(self, x, w, eps, offset: float = 0.0):
        return self._run("rms_norm", x, w, eps=eps, **_offset(offset))

    def add_rms_norm(self, x, residual, w, eps, offset: float = 0.0):
        return self._run("add_rms_norm", x, residual, w, eps=eps, **_offset(offset))

    def rotary(self, q, k, positions, cos_sin):
        return self._run("rotary", q, k, positions, cos_sin)

    def layer_norm_float32(self, x, w, b, eps: float):
        return self._run("layer_norm_float32", x, w, b, eps=float(eps))

    def rotary_interleaved(self, q, k, positions, cos_sin):
        return self._run("rotary_interleaved", q, k, positions, cos_sin)

    def silu_and_mul(self, x):
        return self._run("silu_and_mul", x)

    def gelu_tanh_and_mul(self, x):
        return self._run("gelu_tanh_and_mul", x)

    def softcap(self, x, cap: float):
        return self._run("softcap", x, cap=float(cap))

    def sigmoid_gate(self, g, y):
        return self._run("sigmoid_gate", g, y)

    def layer_norm(self, x, w, b, eps: float):
        return self._run("layer_norm", x, w, b, eps=float(eps))

    def activation(self, x, kind: str):
        return self._run("activation", x, kind=kind)

    def output_gate(self, g, y, function: str, per_head: bool):
        return self._run("output_gate", g, y, function=function, per_head=per_head)

    def attention(self, q, k, v, mask, scale, softcap: float | None = None, window: int | None = None,
                  sinks: torch.Tensor | None = None):
        """sinks: one learned logit per query head beside every row's keys (coverage's attention:sinks)."""
        if sinks is not None:
            return self._run("attention_sinks", q, k, v, mask, sinks, scale=scale,
                             **_attention_options(softcap, window))
        if self.inputs is not None and self.rounds_kv_to_fp8:
            self.inputs.setdefault(ATTENTION_INPUTS, []).append(tuple(t.detach() for t in (q, k, v)))
        return self._run("attention", q, k, v, mask, scale=scale, **_attention_options(softcap, window))

    def moe_route(self, logits, top_k, routing, bias=None):
        """routing: a tic.harness.kernels.routing.Routing, or a softmax router's renormalise flag; bias: the
        selection bias of a routing that has one (no gradient: it only chooses)."""
        return self._run("moe_route", logits, top_k=top_k, routing=routing_mod.as_routing(routing),
                         bias=None if bias is None else bias.detach())

    def moe_experts(self, x, weights, ids, gate_up, down):
        if self.quant is not None and self.quant.covers((gate_up, down)):  # block-FP8 experts: kernels.fp8
            return self._run("fp8_moe_experts", x, weights, ids, gate_up, down, quant=self.quant)
        return self._run("moe_experts", x, weights, ids, gate_up, down)

    def log_softmax(self, logits):
        return self._run("log_softmax", logits)
