"""Fidelity: does the wrapped model (kernels consistent or vllm) compute the stock HF model?

The consistency gates compare the wrapped model with itself (rollout vs training, batch vs alone): a wrapper
that computes another model (a norm's `w` where the model has `1 + w`, a missing softcap) passes all of them
bitwise. This check runs the wrapped model and the stock HF model (eager attention, same weights, dtype and
device) on the same inputs and compares every decoder layer and its submodules, in the stock model's call
order, within a tolerance: the wrappers' kernels round differently from HF's by design, so this is the one
place tic compares with a bound, and it never stands in for a consistency gate.

Bound per module output: max |wrapped - stock| <= rtol * max |stock| + atol, rtol by dtype (FIDELITY_RTOL).
float32 differences are reordering noise (measured ~1e-6 relative on tiny Qwen3/Gemma models); bf16 ones
grow with depth by a rounding step per operator (2^-8 relative), hence its wider bound. A wrong operator
differs by O(1) relative and is caught at its first module. Some models carry a rounding step much further
(sharp attention: the stock bf16 model parts from its own float32 self by more than 5 % within a few layers),
so where a bf16/fp16 module parts, the check runs again layer by layer: every decoder layer of the wrapped model,
the stock model and the stock model in float32 takes the stock model's input to that layer, and each module's bound
becomes at least SPREAD_FACTOR times the float32 model's distance from the stock one there (FP8 excepted: its
reference rounds as the deployment does). A wrong operator still parts at its own layer.

A model generated from config.json holds some weights constant (norm weights at one, biases at zero), and under
them some wrong wrappers compute the right function (a per-head norm commutes with the rotary while its weight is
uniform). So once the forward agrees, it runs again with those constant tensors made uneven (seeded, the same in
both models; uneven_constants), and the wrapped model's own values are put back afterwards.

MoE routers are the one discrete decision on the path: where the wrapped model's experts for a token are within
a rounding step (the dtype's eps) of the stock router's own top-k, the stock router takes them (gradcheck's
RoutingPin); a router that picks other experts outright still parts at its block.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from dataclasses import dataclass

import torch
from torch import nn

from tic.harness.kernels.coverage import layer_lists
from tic.harness.kernels.modules import capture_routes
from tic.harness.kernels.norms import is_norm
from tic.harness.measure.gradcheck import RoutingPin

FIDELITY_RTOL = {torch.float32: 1e-4, torch.float64: 1e-8, torch.bfloat16: 5e-2, torch.float16: 1e-2}
FIDELITY_ATOL = 1e-6
# bf16/fp16, layer by layer: a module may part from the stock model by this many times the stock model's own
# distance from its float32 self on the same layer input (sharp attention carries a rounding step far)
SPREAD_FACTOR = 2.0


@dataclass
class Parting:
    module: str
    module_class: str
    max_abs: float
    ref_max: float
    bound: float
    note: str = ""

    def line(self) -> str:
        return (f"{self.module} ({self.module_class}): max |wrapped - stock| {self.max_abs:.3g} > bound "
                f"{self.bound:.3g} (stock output max {self.ref_max:.3g}){self.note}")


def _compared_modules(named) -> dict[str, nn.Module]:
    """Decoder layers, their submodules and the norms, of (name, module) pairs: where a wrapper's output is the
    HF module's output (lm_head is compared as the logits: the wrapped one applies the final softcap itself). A
    layer is an entry of a module list, whatever the list is called (model.layers, Falcon's transformer.h)."""
    return {name: m for name, m in named
            if any(part.isdigit() for part in name.split(".")) or name.endswith("norm") or is_norm(m)}


def _record(names: dict, sequence_first: set[int]) -> tuple[dict, list, list]:
    seen: dict[str, torch.Tensor] = {}
    order: list[str] = []
    handles = []
    for name, m in names.items():
        def hook(mod, args, out, name=name):
            t = out[0] if isinstance(out, tuple) else out
            if name not in seen and isinstance(t, torch.Tensor):
                t = t.transpose(0, 1) if id(mod) in sequence_first else t
                # a copy: the model may change the output in place later (transformers' OLMoE clamps q/k/v)
                seen[name] = t.detach().to("cpu", torch.float32, copy=True)
                order.append(name)
        handles.append(m.register_forward_hook(hook))
    return seen, order, handles


def _outputs(model: nn.Module, input_ids, attention_mask, modules: dict | None = None,
             sequence_first: set[int] = frozenset(), layer_inputs: dict | None = None,
             forced: dict | None = None) -> tuple[dict, list, torch.Tensor]:
    """Each compared module's output, the call order, the logits. layer_inputs: filled with each decoder layer's
    input; forced: each decoder layer takes this input instead of its own."""
    named = modules.items() if modules is not None else model.named_modules()
    seen, order, handles = _record(_compared_modules(named), sequence_first)
    if layer_inputs is not None or forced is not None:
        handles += _layer_input_hooks(model, layer_inputs, forced)
    try:
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    return seen, order, logits.detach().float().cpu()


def fidelity_inputs(vocab: int, device, seed: int = 0, length: int = 23) -> tuple[torch.Tensor, torch.Tensor]:
    """Two seeded sequences, the second left-padded by a quarter: long enough for a sliding window to slide."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, max(vocab, 4), (2, length), generator=g)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, : length // 4] = 0
    return ids.to(device), mask.to(device)


def compare_forward(stock: nn.Module, wrapped: nn.Module, input_ids, attention_mask,
                    wrapped_modules: dict[str, nn.Module] | None = None,
                    sequence_first: set[int] = frozenset(), quantizer_inputs=None) -> dict:
    """The first module (in the stock model's call order) whose outputs part beyond the bound, and the
    logits' figures. Padding positions are left out (their values are unspecified on both sides).

    The wrapped model's modules are compared under their names, or under those `wrapped_modules` gives them (another
    trainer's model under the HF names); those in `sequence_first` (ids) return [T, B, ...], the stock ones
    [B, T, ...]. quantizer_inputs (fp8_reference.QuantizerInputs, hooked into the stock model): given what the
    wrapped model's FP8 steps rounded (block-FP8 activations, attention inputs over an FP8 KV cache)."""
    dtype = next(stock.parameters()).dtype
    rtol = FIDELITY_RTOL.get(dtype, 5e-2)
    routes = contextlib.nullcontext({}) if not hasattr(wrapped, "_tic_routes") else capture_routes(wrapped)
    ops = getattr(wrapped, "_tic_ops", None) if quantizer_inputs is not None else None
    rounding = ops if ops is not None and ops.quantizes else None  # FP8 weights or an FP8 KV cache
    quantized = contextlib.nullcontext({}) if rounding is None else rounding.capture_inputs()
    with routes as calls, quantized as seen:
        got, _, logits = _outputs(wrapped, input_ids, attention_mask, wrapped_modules, sequence_first)
    if quantizer_inputs is not None:
        quantizer_inputs.current = dict(seen)
    pin = RoutingPin(stock, near_tie=torch.finfo(dtype).eps)  # the wrapped model's experts at a near tie only
    layer_inputs: dict[str, torch.Tensor] = {}
    with pin.pinned({block: ids[0] for block, ids in calls.items()}):
        ref, order, ref_logits = _outputs(stock, input_ids, attention_mask, layer_inputs=layer_inputs)
    keep = attention_mask.bool().cpu()
    checked, first = _first_parting(stock, order + ["logits"], {**ref, "logits": ref_logits},
                                    {**got, "logits": logits}, keep, rtol)
    local = None
    if first is not None and dtype in (torch.bfloat16, torch.float16) and rounding is None \
            and wrapped_modules is None and layer_inputs:
        local = _layer_local(stock, wrapped, layer_inputs, input_ids, attention_mask, keep, rtol)
        checked, first = local.pop("checked"), local.pop("first")
    logit_diff = float((ref_logits - logits)[keep].abs().max())
    return {"dtype": str(dtype).replace("torch.", ""), "rtol": rtol, "atol": FIDELITY_ATOL,
            **({} if local is None else {"layer_local": local}),
            "modules_checked": checked, "first_parting": None if first is None else first.line(),
            "first_parting_module": None if first is None else first.module, "logits_max_abs": logit_diff,
            "routing_flips": pin.flips,
            **({} if rounding is None else quantizer_inputs.counts("wrapped"))}


def _kept(a: torch.Tensor, b: torch.Tensor, keep: torch.Tensor):
    """Both outputs at the unpadded positions (a [B, T, ...] output, or tokens flattened [B * T, ...])."""
    if a.dim() >= 2 and a.shape[:2] == keep.shape:
        return a[keep], b[keep]
    if a.dim() >= 1 and a.shape[0] == keep.numel():  # a MoE block's inside
        return a[keep.reshape(-1)], b[keep.reshape(-1)]
    return a, b


def _first_parting(stock: nn.Module, order: list[str], ref: dict, got: dict, keep: torch.Tensor, rtol: float,
                   spread: dict | None = None) -> tuple[int, Parting | None]:
    """(modules compared, the first whose output parts beyond its bound, or None). spread: per module, the stock
    model's own max distance from its float32 self; the bound is at least SPREAD_FACTOR times that."""
    checked = 0
    for name in order:
        a, b = ref.get(name), got.get(name)
        if b is None or a.shape != b.shape:
            continue
        a, b = _kept(a, b, keep)
        checked += 1
        diff, scale = float((a - b).abs().max()) if a.numel() else 0.0, float(a.abs().max()) if a.numel() else 0.0
        bound = max(rtol * scale + FIDELITY_ATOL, SPREAD_FACTOR * (spread or {}).get(name, 0.0))
        if not diff <= bound:  # a NaN parts too
            cls = "logits" if name == "logits" else type(dict(stock.named_modules())[name]).__name__
            return checked, Parting(name, cls, diff, scale, bound)
    return checked, None


def _layer_local(stock: nn.Module, wrapped: nn.Module, layer_inputs: dict, input_ids, attention_mask,
                 keep: torch.Tensor, rtol: float) -> dict:
    """The check again with every decoder layer of both models, and of the stock model in float32, run on the
    stock model's input to that layer: a rounding step then carries through one layer, not all before it. Each
    module's bound is at least SPREAD_FACTOR times the float32 stock model's distance from the stock model there.
    The routers of both stock models take the wrapped model's experts at near ties, as in the whole forward."""
    eps = torch.finfo(next(stock.parameters()).dtype).eps
    routes = contextlib.nullcontext({}) if not hasattr(wrapped, "_tic_routes") else capture_routes(wrapped)
    with routes as calls:
        got, _, logits = _outputs(wrapped, input_ids, attention_mask, forced=layer_inputs)
    chosen = {block: ids[0] for block, ids in calls.items()}
    with RoutingPin(stock, near_tie=eps).pinned(chosen):
        ref, order, ref_logits = _outputs(stock, input_ids, attention_mask, forced=layer_inputs)
    wide = copy.deepcopy(stock).float()
    with RoutingPin(wide, near_tie=eps).pinned(chosen):
        out, _, wide_logits = _outputs(wide, input_ids, attention_mask,
                                       forced={k: v.float() for k, v in layer_inputs.items()})
    del wide
    ref, out = {**ref, "logits": ref_logits}, {**out, "logits": wide_logits}
    spread = {}
    for name, a in ref.items():
        b = out.get(name)
        if b is not None and b.shape == a.shape:
            a, b = _kept(a, b, keep)
            spread[name] = float((a - b).abs().max()) if a.numel() else 0.0
    checked, first = _first_parting(stock, order + ["logits"], ref, {**got, "logits": logits}, keep, rtol, spread)
    if first is not None:
        first.note = ", each decoder layer on the stock model's input to it"
    return {"checked": checked, "first": first, "layers": len(layer_inputs), "spread_factor": SPREAD_FACTOR}


def _layer_input_hooks(model: nn.Module, record: dict | None, forced: dict | None) -> list:
    """Forward pre-hooks on the decoder layers: record each one's hidden-states input, or hand it the forced one
    instead; the first call of each layer only (a layer a model runs twice takes its own input the second time)."""
    called: set[str] = set()

    def hook(mod, args, kwargs, name):
        x = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(x, torch.Tensor) or name in called:
            return None
        called.add(name)
        if record is not None:
            record[name] = x.detach().clone()
        if forced is None or name not in forced:
            return None
        given = forced[name].to(device=x.device, dtype=x.dtype)
        return ((given, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": given})
    layers = {f"{name}.{i}": layer for name, lst in layer_lists(model) for i, layer in enumerate(lst)}
    return [m.register_forward_pre_hook(functools.partial(hook, name=name), with_kwargs=True)
            for name, m in layers.items()]


@contextlib.contextmanager
def uneven_constants(stock: nn.Module, wrapped: nn.Module, seed: int = 0):
    """Within the block, every floating parameter of the stock model whose elements are all equal (a norm's ones, a
    bias's zeros) takes seeded uneven values, and the wrapped model's parameter of the same name the same ones;
    yields their names. The wrapped model's values are restored on exit (the stock model is the check's own)."""
    theirs = dict(wrapped.named_parameters())
    g = torch.Generator().manual_seed(seed)
    changed: dict[str, torch.Tensor] = {}
    try:
        with torch.no_grad():
            for name, p in stock.named_parameters():
                q = theirs.get(name)
                if not p.is_floating_point() or p.numel() < 2 or q is None or q.shape != p.shape \
                        or not bool((p == p.reshape(-1)[0]).all()):
                    continue
                c = float(p.reshape(-1)[0])
                spread = 0.25 * (abs(c) if c else 0.4)  # ones -> 1 +- 0.25, zeros -> +- 0.1
                value = (c + spread * torch.randn(p.shape, generator=g)).to(p.dtype)
                changed[name] = q.detach().clone()
                p.copy_(value.to(p.device))
                q.copy_(value.to(q.device))
        yield list(changed)
    finally:
        with torch.no_grad():
            for name, kept in changed.items():
                theirs[name].copy_(kept)
