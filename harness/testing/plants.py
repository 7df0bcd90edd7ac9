"""Single-point divergences planted on one engine's model, and the check of what the locator says about them.

A plant changes one module's own arithmetic, by wrapping that module's forward on an engine's copy of the model:
an attribute (a norm's eps), a torch function called inside the module (swapped for another implementation,
split into partial sums, scaled elsewhere, rounded through bfloat16, run in float64, a tie broken the other way),
the module's output or one of its keyword inputs rounded or scaled, a weight's memory layout (the same values at
another alignment, or column-major), or, on tic's kernel wrappers, one of that module's kernels (a kernel whose
arithmetic follows the launch's row count, as GPU kernels' block sizes do). Calls inside child modules are left
alone, so the plant sits in exactly one module. A condition can make it a batch- or length-dependent branch. A
plant is installed on one side, or, when the divergence it stands for comes from the two sides' layouts (the same
kernel launched on few rows and on many), on both. Nothing here knows how the locator works: a trial runs
`tic.harness.locate.search.locate` on the two sides and compares its answer with the plant's module, its layer and the
operators the plant introduces or changes.
"""

from __future__ import annotations

import copy
import functools
import random
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from tic.core.errors import TicInputError
from tic.harness.engines.base import Sampling
from tic.harness.engines.hf import HFEngine
from tic.harness.kernels.autograd import Ops, attention_ref
from tic.harness.locate import report
from tic.harness.locate.capture import CaptureSpec, rows_equal
from tic.harness.locate.hf_capture import HFCaptureRunner
from tic.harness.locate.search import Side, locate, recheck_repro
from tic.harness.testing import plant_kernels
from tic.harness.testing.tinymodels import tiny_model

LINEAR_OPS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.linear.default",
              "aten.matmul.default")
ROUND = ("aten._to_copy.default", "aten.to.dtype", "prims.convert_element_type.default")
# moving a scale across a GEMM changes the scaling operators and the GEMM's input
SCALE = ("aten.mul.Tensor", "aten.div.Tensor", "aten.matmul.default") + LINEAR_OPS


@dataclass
class Plant:
    kind: str  # what the plant does, e.g. "eps", "split-k", "bf16 round trip of the output"
    module: str  # the module it sits in: the culprit the locator must name
    layer: str  # the stage holding that module: the first divergent layer
    operators: tuple  # the operators the plant introduces or changes (the first divergent operator is one)
    side: str  # "a" or "b" (with `both`, the side the check without the plant records again)
    install: Callable[[nn.Module], Callable[[], None]] = field(repr=False)  # returns the uninstaller
    prepare: Callable[[nn.Module], None] | None = field(default=None, repr=False)  # both sides (e.g. tied router)
    op_class: str = ""  # the operator class it changes: norm, rotary, attention core, GEMM, routing, ...
    both: bool = False  # installed on both sides: the divergence is the two layouts' (a launch's row count)

    def describe(self) -> str:
        return f"{self.kind} in {self.module} ({'both sides' if self.both else f'side {self.side.upper()}'})"


# -- the mechanism: a module's forward wrapped, torch functions swapped inside it, children untouched ---------
class _Swap(TorchFunctionMode):
    """Replaces torch functions by name while active, except inside the planted module's children."""

    def __init__(self, table: dict[str, Callable]):
        super().__init__()
        self.table = table
        self.paused = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        fn = None if self.paused else self.table.get(getattr(func, "__name__", ""))
        if fn is None:
            return func(*args, **kwargs)
        return fn(func, *args, **kwargs)


def _wrap_forward(m: nn.Module, wrapper: Callable[[Callable], Callable]) -> Callable[[], None]:
    had = "forward" in m.__dict__
    old = m.__dict__.get("forward")
    m.forward = wrapper(m.forward)

    def undo():
        if had:
            m.forward = old
        else:
            del m.forward
    return undo


def _first_tensor(args, kwargs):
    return next((v for v in list(args) + list(kwargs.values()) if isinstance(v, torch.Tensor)), None)


def _condition_holds(cond, args, kwargs) -> bool:
    if cond is None:
        return True
    x = _first_tensor(args, kwargs)
    if x is None or x.dim() == 0:
        return False
    kind, n = cond
    rows = x.numel() // max(1, x.shape[-1])
    length = x.shape[-2] if x.dim() >= 3 else x.shape[0]
    return rows >= n if kind == "rows" else length >= n


def swap_in(module_name: str, table: dict[str, Callable], cond=None):
    """An installer: inside the module's own forward (not its children's), torch functions named in `table` run
    as table[name](original, *args, **kwargs); with `cond`, only on calls that meet it."""
    def install(model: nn.Module):
        m = model.get_submodule(module_name)
        mode = _Swap(table)
        undo = []

        def outer(fwd):
            def planted(*args, **kwargs):
                if not _condition_holds(cond, args, kwargs):
                    return fwd(*args, **kwargs)
                with mode:
                    return fwd(*args, **kwargs)
            return planted

        def pause(fwd):
            def child(*args, **kwargs):
                mode.paused += 1
                try:
                    return fwd(*args, **kwargs)
                finally:
                    mode.paused -= 1
            return child

        undo.append(_wrap_forward(m, outer))
        for c in m.children():
            undo.append(_wrap_forward(c, pause))
        return lambda: [u() for u in reversed(undo)]
    return install


def around(module_name: str, before: Callable | None = None, after: Callable | None = None, cond=None):
    """An installer: the module's forward with its inputs (args, kwargs) -> (args, kwargs) changed by `before`
    and its output changed by `after`."""
    def install(model: nn.Module):
        m = model.get_submodule(module_name)

        def outer(fwd):
            def planted(*args, **kwargs):
                if not _condition_holds(cond, args, kwargs):
                    return fwd(*args, **kwargs)
                if before is not None:
                    args, kwargs = before(args, kwargs)
                out = fwd(*args, **kwargs)
                return out if after is None else after(out)
            return planted
        return _wrap_forward(m, outer)
    return install


def set_attribute(module_name: str, attr: str, value) -> Callable:
    def install(model: nn.Module):
        m = model.get_submodule(module_name)
        old = getattr(m, attr)
        setattr(m, attr, value)
        return lambda: setattr(m, attr, old)
    return install


def kernel_swap(module_name: str, **kernels: Callable) -> Callable:
    """An installer for a model on tic's kernel wrappers: the module's own operators run `kernels` (by provider
    method name, e.g. rms_norm; each called as kernel(provider, *args)) in place of its provider's; every other
    module keeps the provider's."""
    def install(model: nn.Module):
        m = model.get_submodule(module_name)
        old = m._tic_ops
        provider = copy.copy(old.provider)  # its other methods call the replaced kernels through self
        for name, fn in kernels.items():
            setattr(provider, name, functools.partial(fn, provider))
        m._tic_ops = Ops(provider, old.backward, old.table)
        return lambda: setattr(m, "_tic_ops", old)
    return install


def weight_layout(module_name: str, relayout: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """An installer: the module's weight holds the same values in memory laid out by `relayout` (another address,
    column-major strides)."""
    def install(model: nn.Module):
        m = model.get_submodule(module_name)
        old = m.weight
        m.weight = nn.Parameter(relayout(old.detach()), requires_grad=old.requires_grad)
        return lambda: setattr(m, "weight", old)
    return install


def _misaligned(floats: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def relayout(w):
        moved = torch.empty(w.numel() + floats, dtype=w.dtype, device=w.device)[floats:].view_as(w)
        return moved.copy_(w)
    return relayout


def _column_major(w: torch.Tensor) -> torch.Tensor:
    return w.t().contiguous().t()


def _round(x):
    return x.to(torch.bfloat16).to(x.dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _first(fn):
    """fn applied to a module output's first tensor (a tuple's first element)."""
    def apply(out):
        return (fn(out[0]),) + out[1:] if isinstance(out, tuple) else fn(out)
    return apply


_round_first = _first(_round)


# -- the swapped functions -------------------------------------------------------------------------------
def _split_k(orig, x, w, b=None):  # F.linear as two partial sums over halves of the reduction
    h = max(1, x.shape[-1] // 2)
    y = orig(x[..., :h], w[:, :h]) + orig(x[..., h:], w[:, h:])
    return y if b is None else y + b


def _scaled_linear(orig, x, w, b=None):  # the same product with a scale moved in front of the GEMM and back
    y = orig(x * 3.0, w) / 3.0
    return y if b is None else y + b


def _scaled_matmul(orig, a, b, **kw):
    return orig(a * 3.0, b, **kw) / 3.0


def _cat_first_rounded(orig, tensors, *a, **kw):  # a cat of several traced tensors, its first piece rounded
    return orig([_round(tensors[0])] + list(tensors[1:]), *a, **kw)


def _float64_linear(orig, x, w, b=None):  # the GEMM in float64, its result cast back
    return orig(x.double(), w.double(), None if b is None else b.double()).to(x.dtype)


def _mean_in_halves(orig, x, dim=None, keepdim=False, **kw):  # a mean over the last dimension as two partial sums
    if dim not in (-1, [-1], (-1,), x.dim() - 1) or x.shape[-1] < 2:
        return orig(x, dim, keepdim, **kw) if dim is not None else orig(x, **kw)
    h = x.shape[-1] // 2
    return (x[..., :h].sum(-1, keepdim=keepdim) + x[..., h:].sum(-1, keepdim=keepdim)) / x.shape[-1]


def _scaled_operands(orig, a, b, *rest, **kw):  # a scale moved across an add or a product, and back
    return orig(a * 3.0, b * 3.0 if isinstance(b, torch.Tensor) else b, *rest, **kw) / (9.0 if _is_mul(orig) else 3.0)


def _is_mul(fn) -> bool:
    return getattr(fn, "__name__", "") in ("mul", "__mul__")


def _key_split(min_keys: int):
    def matmul(orig, a, b, **kw):  # a reduction over keys split in two halves (only for long rows)
        k = a.shape[-1]
        if k < max(2, min_keys) or b.dim() < 2 or b.shape[-2] != k:
            return orig(a, b, **kw)
        h = k // 2
        return orig(a[..., :h], b[..., :h, :]) + orig(a[..., h:], b[..., h:, :])
    return matmul


def _manual_softmax(orig, x, dim=-1, dtype=None, **kw):
    x = x if dtype is None else x.to(dtype)
    e = (x - x.amax(dim=dim, keepdim=True)).exp()
    return e / e.sum(dim=dim, keepdim=True)


def _rsqrt_as_sqrt(orig, x, *a, **kw):
    return torch.reciprocal(torch.sqrt(x))


def _silu_manual(orig, x, *a, **kw):
    return x * torch.sigmoid(x)


def _gelu_manual(orig, x, approximate="none", **kw):  # GELU's tanh form written out
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


def _round_result(orig, *a, **kw):
    return _round(orig(*a, **kw))


def _topk_high_index_first(orig, x, k, dim=-1, **kw):  # ties go to the higher index
    v, i = orig(x.flip(dim), k, dim=dim, **kw)
    return v, x.shape[dim] - 1 - i


def _sort_high_index_first(orig, x, dim=-1, descending=False, stable=False, **kw):
    # a selection by sorting (a stable sort gives ties to the lower index): ties go to the higher index
    v, i = orig(x.flip(dim), dim=dim, descending=descending, stable=True, **kw)
    return torch.return_types.sort((v, x.shape[dim] - 1 - i))


# -- the catalogue ---------------------------------------------------------------------------------------
def _stage_of(name: str) -> str:
    m = re.match(r"(.*\.layers\.\d+)", name)
    return m.group(1) if m else name


SILU = ("SiLU", "SiLUActivation")
GELU = ("GELUTanh", "PytorchGELUTanh", "GELUActivation", "NewGELUActivation")


def _kind_of(name: str, m: nn.Module) -> str | None:
    if name.endswith("embed_tokens"):
        return "embed"
    if name.endswith("rotary_emb"):
        return "rotary"
    if type(m).__name__.endswith("RMSNorm"):
        return "norm"
    if isinstance(m, nn.Linear):
        return "linear"
    if type(m).__name__ in SILU + GELU:
        return "act"
    if name.endswith("self_attn"):
        return "attention"
    if hasattr(m, "gate") and hasattr(m, "experts") and hasattr(m.gate, "top_k"):
        return "moe"
    if name.endswith(".mlp"):
        return "mlp"
    if re.search(r"\.layers\.\d+$", name):
        return "layer"
    return None


def _branch(rng: random.Random, branches: bool = True):
    """Now and then a batch- or length-dependent branch: the plant acts only on calls with enough rows."""
    r = rng.random()
    if not branches:
        return None, ""
    if r < 0.15:
        return ("rows", rng.choice([2, 3, 4, 6])), " (batch-dependent branch)"
    if r < 0.3:
        return ("length", rng.choice([2, 3, 4, 6])), " (length-dependent branch)"
    return None, ""


def _tie_router(layer_mlp: str):
    def prepare(model: nn.Module):
        with torch.no_grad():
            w = model.get_submodule(layer_mlp).gate.weight
            w[1:3] = w[0]
            w[0:3] *= 8  # three tied experts win, so the tie decides which two are chosen
    return prepare


def draw_plant(model: nn.Module, rng: random.Random, side: str, branches: bool = True,
               layouts: bool = True) -> Plant:
    """One random plant over the modules this model calls (norms, projections incl. the head, activations,
    attention, MLP or MoE block, decoder layer, embeddings, rotary, final norm) and the plants that apply to its
    kernels (tic's wrappers or stock transformers). Without `branches`, no batch- or length-dependent branch;
    without `layouts` (the two sides run one layout, or both carry the plant), no plant whose divergence is the
    two layouts' (a kernel following the launch's rows)."""
    wrapped = getattr(model, "_tic_provider", None) is not None
    allowed = {"any", "wrapped" if wrapped else "stock"} | ({"layouts"} if wrapped and layouts else set())
    options = defaultdict(list)  # maker -> the modules it can plant in: a kind is drawn first, then its module
    for name, m in model.named_modules():
        for make, when, fits in _PLANTS.get(_kind_of(name, m), []):
            if when in allowed and fits(m):
                options[make].append(name)
    make = rng.choice(list(options))
    return make(rng.choice(options[make]), rng, side, model, branches)


def _p(kind, name, ops, side, install, prepare=None, op_class="", both=False):
    return Plant(kind, name, _stage_of(name), tuple(ops), side, install, prepare, op_class, both)


def _eps_attr(m: nn.Module) -> str:
    return "variance_epsilon" if hasattr(m, "variance_epsilon") else "eps"


def _eps(name, rng, side, model, branches=True):
    attr = _eps_attr(model.get_submodule(name))
    new = getattr(model.get_submodule(name), attr) * rng.choice([10.0, 0.1, 3.0])
    return _p("eps", name, ["aten.add.Tensor"], side, set_attribute(name, attr, new), op_class="norm")


def _eps_branch(name, rng, side, model, branches=True):
    m = model.get_submodule(name)
    attr = _eps_attr(m)
    new = getattr(m, attr) * rng.choice([10.0, 0.1])
    cond, tag = _branch(rng)
    if not branches:
        return _p("eps", name, ["aten.add.Tensor"], side, set_attribute(name, attr, new), op_class="norm")
    cond = cond or ("rows", 2)
    tag = tag or " (batch-dependent branch)"

    def install(model):
        mod = model.get_submodule(name)
        old = getattr(mod, attr)

        def outer(fwd):
            def planted(*args, **kwargs):
                setattr(mod, attr, new if _condition_holds(cond, args, kwargs) else old)
                try:
                    return fwd(*args, **kwargs)
                finally:
                    setattr(mod, attr, old)
            return planted
        return _wrap_forward(mod, outer)
    return _p("eps" + tag, name, ["aten.add.Tensor"], side, install, op_class="norm")


def _swap_plant(kind, table, ops, op_class, with_branch=True):
    def make(name, rng, side, model, branches=True):
        cond, tag = _branch(rng, branches) if with_branch else (None, "")
        return _p(kind + tag, name, ops, side, swap_in(name, table, cond), op_class=op_class)
    return make


def _output_round(op_class):
    def make(name, rng, side, model, branches=True):
        cond, tag = _branch(rng, branches)
        return _p("bf16 round trip of the output" + tag, name, ROUND, side, around(name, after=_round_first, cond=cond),
                  op_class=op_class)
    return make


def _output_scaled(op_class):
    def make(name, rng, side, model, branches=True):
        c = rng.choice([1.0001, 0.9999, 1.001])
        return _p("output multiplied by a constant", name, ("aten.mul.Tensor",), side,
                  around(name, after=_first(lambda t: t * c if t.is_floating_point() else t)), op_class=op_class)
    return make


def _position_round(name, rng, side, model, branches=True):
    def before(args, kwargs):
        pe = kwargs.get("position_embeddings")
        if isinstance(pe, tuple):
            kwargs = dict(kwargs, position_embeddings=(_round(pe[0]),) + tuple(pe[1:]))
        return args, kwargs
    return _p("bf16 round trip of the position embeddings passed on", name, ROUND, side, around(name, before=before),
              op_class="rotary")


def _key_split_plant(name, rng, side, model, branches=True):
    n = rng.choice([3, 4, 5, 6, 8])
    return _p(f"attention reduction over keys split in two (rows of >= {n} keys: length-dependent branch)", name,
              LINEAR_OPS + ("aten.add.Tensor",), side, swap_in(name, {"matmul": _key_split(n)}),
              op_class="attention core")


def _tie_break(name, rng, side, model, branches=True):
    # the router picks its experts by top-k or by a sort, depending on the kernels: both break ties the other way
    return _p("top-k ties broken towards the higher expert index", name,
              ("aten.flip.default", "aten.rsub.Scalar", "aten.topk.default", "aten.sort.stable",
               "aten.sort.default"), side,
              swap_in(name, {"topk": _topk_high_index_first, "sort": _sort_high_index_first}),
              prepare=_tie_router(name), op_class="routing")


def _weight_layout(kind, relayouts):
    def make(name, rng, side, model, branches=True):
        return _p(kind, name, LINEAR_OPS, side, weight_layout(name, rng.choice(relayouts)), op_class="memory layout")
    return make


# kernels of tic's wrappers for one module, by provider method: (provider, *args) -> value
def _norm_by_rows(provider, x, w, eps):
    return plant_kernels.rms_norm(x, w, eps)


def _linear_over_the_launch(provider, x, w, b=None):
    return F.linear(x, w, b)


def _attention_over_the_launch(provider, q, k, v, mask, scale):
    return attention_ref(q, k, v, mask, scale).to(q.dtype)


def _experts_with_rounded_weights(provider, x, weights, ids, gate_up, down):
    return type(provider).moe_experts(provider, x, _round(weights.to(torch.bfloat16)).to(weights.dtype), ids,
                                      gate_up, down)


def _kernel_plant(kind, method, kernel, ops, op_class, both):
    def make(name, rng, side, model, branches=True):
        return _p(kind, name, ops, side, kernel_swap(name, **{method: kernel}), op_class=op_class, both=both)
    return make


NORM_KERNEL = ("plant_kernels.rms_norm.default",)
ATTENTION_OPS = ("aten.scaled_dot_product_attention.default", "aten._scaled_dot_product_flash_attention_for_cpu.default",
                 "aten.repeat_interleave.self_int", "aten.where.self", "aten.transpose.int", "aten._to_copy.default")
LAUNCH = "kernel following the launch's row count"
RESIDUAL_OPS = ("aten.add.Tensor", "aten.mul.Tensor", "aten.div.Tensor")


def _any(m: nn.Module) -> bool:
    return True


def _named(*names: str) -> Callable[[nn.Module], bool]:
    return lambda m: type(m).__name__ in names


_silu, _gelu = _named(*SILU), _named(*GELU)
# kind -> [(maker, when, fits)]: `when` "any" kernels; "wrapped" tic's kernel wrappers only; "stock" transformers'
# own modules only (the wrappers never call an activation module, and their attention reads its own rotary
# table and multiplies per query row); "layouts" wrappers, when the two sides run different layouts (a kernel
# whose arithmetic follows the launch, on both sides or on one). `fits(module)`: the modules it applies to.
_PLANTS: dict[str, list[tuple[Callable, str, Callable]]] = {
    "embed": [(_output_round("embedding"), "any", _any), (_output_scaled("embedding"), "any", _any)],
    "rotary": [(_output_round("rotary"), "stock", _any)],
    "norm": [(_eps, "any", _any), (_eps_branch, "any", _any),
             (_swap_plant("rsqrt as reciprocal of sqrt", {"rsqrt": _rsqrt_as_sqrt},
                          ("aten.sqrt.default", "aten.reciprocal.default"), "norm"), "any", _any),
             (_swap_plant("mean of squares as two partial sums", {"mean": _mean_in_halves},
                          ("aten.sum.dim_IntList", "aten.add.Tensor", "aten.div.Tensor"), "norm"), "any", _any),
             (_output_round("norm"), "any", _any), (_output_scaled("norm"), "any", _any),
             (_swap_plant("scale placement in the residual add", {"__add__": _scaled_operands, "add": _scaled_operands},
                          RESIDUAL_OPS, "residual add", with_branch=False), "wrapped", _any),
             (_kernel_plant(f"norm {LAUNCH}", "rms_norm", _norm_by_rows, NORM_KERNEL, "norm", True), "layouts", _any),
             (_kernel_plant(f"norm {LAUNCH}", "rms_norm", _norm_by_rows, NORM_KERNEL, "norm", False), "layouts",
              _any)],
    "linear": [(_swap_plant("split-k reduction", {"linear": _split_k}, LINEAR_OPS + ("aten.add.Tensor",), "GEMM"),
                "any", _any),
               (_swap_plant("scale placement", {"linear": _scaled_linear}, SCALE, "GEMM"), "any", _any),
               (_swap_plant("bf16 round trip of the GEMM result", {"linear": _round_result}, ROUND, "GEMM"), "any",
                _any),
               (_swap_plant("GEMM in float64", {"linear": _float64_linear}, LINEAR_OPS, "GEMM"), "any", _any),
               (_weight_layout("weight at another alignment", [_misaligned(1), _misaligned(2), _misaligned(3)]),
                "any", _any),
               (_weight_layout("weight column-major", [_column_major]), "any", _any),
               (_kernel_plant(f"GEMM {LAUNCH}", "linear", _linear_over_the_launch, LINEAR_OPS, "GEMM", True),
                "layouts", _any)],
    "act": [(_swap_plant("silu as x * sigmoid(x)", {"silu": _silu_manual}, ("aten.sigmoid.default", "aten.mul.Tensor"),
                         "activation"), "stock", _silu),
            (_swap_plant("gelu written out", {"gelu": _gelu_manual}, ("aten.mul.Tensor", "aten.add.Tensor",
                                                                      "aten.tanh.default", "aten.pow.Tensor_Scalar"),
                         "activation"), "stock", _gelu),
            (_output_round("activation"), "stock", _any)],
    "attention": [(_swap_plant("scale placement", {"matmul": _scaled_matmul}, SCALE, "attention core"), "wrapped",
                   _any),
                  (_swap_plant("softmax as exp / sum", {"softmax": _manual_softmax},
                               ("aten.amax.default", "aten.sub.Tensor", "aten.exp.default"), "attention core"), "any",
                   _any),
                  (_key_split_plant, "wrapped", _any),
                  (_swap_plant("bf16 round trip of the rotary products", {"__mul__": _round_result,
                                                                          "mul": _round_result}, ROUND, "rotary"),
                   "any", _any),
                  (_output_scaled("attention core"), "any", _any),
                  (_swap_plant("bf16 round trip of the first piece of rotate-half's cat", {"cat": _cat_first_rounded},
                               ROUND, "rotary"), "any", _any),
                  (_kernel_plant(f"attention {LAUNCH}", "attention", _attention_over_the_launch, ATTENTION_OPS,
                                 "attention core", True), "layouts", _any)],
    "mlp": [(_swap_plant("bf16 round trip of the gated product", {"__mul__": _round_result, "mul": _round_result},
                         ROUND, "activation"), "any", _any),
            (_swap_plant("silu as x * sigmoid(x) in the gated product", {"silu": _silu_manual},
                         ("aten.sigmoid.default", "aten.mul.Tensor"), "activation"), "wrapped", _any),
            (_output_scaled("activation"), "any", _any),
            (_swap_plant("bf16 round trip of the gate projection before its cat with the up projection",
                         {"cat": _cat_first_rounded}, ROUND, "activation"), "wrapped", _any)],
    "moe": [(_tie_break, "wrapped", _any),  # transformers' own MoE blocks select experts in a child module
            (_swap_plant("split-k reduction", {"linear": _split_k}, LINEAR_OPS + ("aten.add.Tensor",), "GEMM"),
             "wrapped", _any),
            (_swap_plant("router softmax as exp / sum", {"softmax": _manual_softmax},
                         ("aten.amax.default", "aten.sub.Tensor", "aten.exp.default"), "routing"), "wrapped", _any),
            (_swap_plant("bf16 round trip of the weighted expert outputs",
                         {"__mul__": _round_result, "mul": _round_result}, ROUND, "expert combine"), "wrapped", _any),
            (_swap_plant("scale placement in the expert weighting", {"__mul__": _scaled_operands, "mul": _scaled_operands},
                         SCALE, "expert combine"), "wrapped", _any),
            (_kernel_plant("expert combine kernel rounding the routing weights through bf16", "moe_experts",
                           _experts_with_rounded_weights, ROUND, "expert combine", False), "wrapped", _any),
            (_output_scaled("expert combine"), "any", _any)],
    "layer": [(_swap_plant("bf16 round trip of the residual sums", {"__add__": _round_result, "add": _round_result},
                           ROUND, "residual add", with_branch=False), "any", _any),
              (_swap_plant("scale placement in the residual sums", {"__add__": _scaled_operands, "add": _scaled_operands},
                           RESIDUAL_OPS, "residual add", with_branch=False), "any", _any),
              (_position_round, "stock", _any)],
}


# -- a trial ---------------------------------------------------------------------------------------------
def _short(op: str) -> str:
    return op.removesuffix(".default")


def operator_named(found: str | None, expected: tuple) -> bool:
    """Whether the locator's operator answer names one of the plant's operators (one operator, or the list of
    operators only one side runs when the two sides compute the module differently)."""
    if not found:
        return False
    names = {_short(t) for t in re.split(r"[\s,|:]+", found) if "." in t}
    return any(_short(e) in names for e in expected)


def planted_side_operator(res: dict, side: str) -> str | None:
    """The operator the locator names on the planted side: its call of the pair, or, when the two sides compute the
    value with different operator sequences, that side's own first call whose value the other never computes."""
    calls = (res.get("difference") or {}).get("calls") or {}
    return (calls.get(side.upper()) or {}).get("operator") or res.get("first_operator")


def _samples(engine, rng: random.Random, vocab: int, upto: int):
    n = rng.randint(2, 4)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 9))] for _ in range(n)]
    return engine.generate(prompts, Sampling(temperature=1.0, max_tokens=upto + 1, seed=rng.randrange(1 << 30)),
                           list(range(n)))


def _engines(model_dir: Path, kernels: str, rng: random.Random, same_layout: bool) -> dict:
    """Side A's and side B's engines over private copies of one model: side A's decode batch and side B's scoring
    micro-batch drawn apart, or, with `same_layout`, one batch size and micro-batch for both."""
    base = HFEngine(model_dir, "float32", kernels=kernels, batch_size=rng.randint(1, 4),
                    micro_batch_size=rng.randint(1, 3))
    engines = {}
    for s in ("a", "b"):
        e = copy.copy(base)
        e.model = copy.deepcopy(base.model)
        engines[s] = e
    if not same_layout:
        engines["a"].batch_size = rng.randint(1, 4)
        engines["b"].micro_batch_size = rng.randint(1, 3)
    return engines


def _trial(seed: int, mode: str, family: str | None, kernels: str | None, models_per_family_seed: int) -> dict:
    """Everything a trial draws from its seed: model, kernels, engines, plant (not installed yet), the compared
    sequence and the two sides, and the trial's record so far."""
    rng = random.Random(seed)
    model_dir, cfg = tiny_model(seed // models_per_family_seed, family)
    upto = rng.randint(1, 3)
    kernels = kernels or ("stock" if rng.random() < 1 / 3 else "consistent")
    try:
        engines = _engines(model_dir, kernels, rng, same_layout=kernels == "stock")
    except TicInputError:  # e.g. sliding-window layers, which the wrappers do not cover
        kernels = "stock"
        engines = _engines(model_dir, kernels, rng, same_layout=True)
    layouts_differ = kernels != "stock"
    side = rng.choice("ab")
    plant = None if mode == "clean" else draw_plant(engines[side].model, rng, side,
                                                    branches=mode == "plant" and layouts_differ,
                                                    layouts=mode == "plant" and layouts_differ)
    if plant is not None and plant.prepare is not None:
        for e in engines.values():
            plant.prepare(e.model)
    samples = _samples(engines["a"], rng, cfg["vocab_size"], upto)
    target = rng.randrange(len(samples))
    ra, rb = HFCaptureRunner(engines["a"]), HFCaptureRunner(engines["b"])

    def run(runner, how):
        if how == "score":
            return lambda spec: runner.score(samples, target, spec)
        return lambda spec: runner.decode(samples, target, upto, spec)

    # the wrappers: side A decodes, side B scores; stock: both sides decode, or both score
    how_a, how_b = ("decode", "score") if layouts_differ else 2 * (rng.choice(["decode", "score"]),)
    side_a, side_b = Side(how_a, ra, run(ra, how_a)), Side(how_b, rb, run(rb, how_b))
    rec = {"seed": seed, "mode": mode, "family": cfg["model_type"], "kernels": kernels,
           "layouts": f"{side_a.label} / {side_b.label}", "plant": plant.describe() if plant else None,
           "kind": plant.kind if plant else None, "op_class": plant.op_class if plant else None,
           "both": plant.both if plant else None, "side": side if plant else None}
    return {"rec": rec, "plant": plant, "side": side, "engines": engines, "upto": upto, "sides": (side_a, side_b)}


def _install(t: dict, mode: str) -> list[Callable[[], None]]:
    """Install the trial's plant and record the ground truth: whether it changes its module's output on the
    compared sequence ("effective") and reaches a compared stage or the logprob ("reaches_output": a change rounded
    away downstream is no divergence to locate). A plant on both sides is seen as the difference it makes between
    the two sides' layouts. The uninstallers."""
    plant, side, engines, rec = t["plant"], t["side"], t["engines"], t["rec"]
    side_a, side_b = t["sides"]
    run_planted = side_a.run if side == "a" else side_b.run
    watched = set(side_a.runner.stages()) | {plant.module}
    targets = [engines[side]] if mode == "plant" and not plant.both else list(engines.values())
    if plant.both:
        undo = [plant.install(e.model) for e in targets]
        before, after = side_a.run(CaptureSpec(outputs=watched)), side_b.run(CaptureSpec(outputs=watched))
    else:
        before = run_planted(CaptureSpec(outputs=watched))
        undo = [plant.install(e.model) for e in targets]
        after = run_planted(CaptureSpec(outputs=watched))

    def changed(name):
        x, y = before.outputs.get(name, {}), after.outputs.get(name, {})
        return any(not rows_equal(x[p], y[p]) for p in x if p in y)
    rec["effective"] = changed(plant.module)
    rec["reaches_output"] = any(changed(n) for n in watched - {plant.module}) or any(
        not rows_equal((before.logprobs[p],), (after.logprobs[p],)) for p in before.logprobs if p in after.logprobs)
    return undo


def _recheck(t: dict, found, undo: list, out_dir: Path, remove_plant: bool) -> dict:
    """The emitted repro again, its planted side's entry recorded anew: without the plant (or, as a self-check
    that the recheck can fail, with it)."""
    plant = t["plant"]
    if remove_plant:
        for u in undo:
            u()
    t1 = time.perf_counter()
    try:
        again = recheck_repro(*t["sides"], found, "AB" if plant.both else plant.side, out_dir / "without-plant")
        got = dict(repro_exit_without_plant=again["exit_code"], repro_without_plant_kind=again["kind"],
                   repro_without_plant_output=(again.get("output") or "")[-300:])
    except Exception as e:  # noqa: BLE001  counted, not fatal to the benchmark
        got = dict(repro_exit_without_plant=None, repro_without_plant_kind="crash",
                   repro_without_plant_output=f"{type(e).__name__}: {e}")
    return {**got, "recheck_seconds": time.perf_counter() - t1}


def _judged(res: dict, plant: Plant | None, mode: str) -> dict:
    """The locator's answer against the plant's truth, or, for a control, whether it stayed clean."""
    if plant is not None and mode == "plant":
        return dict(expected_layer=plant.layer, expected_module=plant.module, expected_operators=plant.operators,
                    layer_right=res["first_divergent_layer"] == plant.layer,
                    module_right=res["culprit_module"] == plant.module,
                    operator_right=operator_named(planted_side_operator(res, plant.side), plant.operators))
    return {"clean": res["first_divergent_layer"] is None and res["status"] == "no divergence" and not res["repro"]}


def run_trial(seed: int, out_dir: Path, mode: str = "plant", family: str | None = None, kernels: str | None = None,
              models_per_family_seed: int = 4, remove_plant_for_recheck: bool = True) -> dict:
    """One trial: a random tiny model, random kernels, a random compared sequence and layouts, and
      mode "plant": one random plant on one random side (or, for a kernel following the launch's rows, on both)
        -> what the locator says, judged against the plant; then the plant is removed and the emitted repro is run
        again with the planted side's entry recorded anew (tic.harness.locate.search.recheck_repro; both sides' modules
        for a plant on both): it must exit 0 (`repro_exit_without_plant`). With `remove_plant_for_recheck=False`
        the plant stays for that rerun, which must then exit 1: a self-check that the recheck can fail;
      mode "clean": nothing planted -> must report no divergence and emit no repro;
      mode "symmetric": the same random plant on both sides -> must report no divergence and emit no repro.
    Kernels ("consistent": tic's CPU kernel wrappers, side A decoding and side B scoring in layouts of their own;
    "stock": transformers' own modules, both sides in one layout, decoding or scoring, since stock CPU kernels
    differ between layouts by themselves) are drawn from the seed unless given; stock for a family the wrappers
    do not cover. A plant that changes nothing on the compared sequence (e.g. a branch never taken) is reported
    "ineffective", one whose change is rounded away before any compared stage "absorbed"."""
    t = _trial(seed, mode, family, kernels, models_per_family_seed)
    rec, plant, out_dir = t["rec"], t["plant"], Path(out_dir)
    undo = []
    if plant is not None:
        undo = _install(t, mode)
        if mode == "plant" and not (rec["effective"] and rec["reaches_output"]):
            for u in undo:
                u()
            return {**rec, "status": "ineffective" if not rec["effective"] else "absorbed"}
    t0 = time.perf_counter()
    try:
        found = locate(*t["sides"], out_dir, "plant", t["upto"])
        res = report.write(found, out_dir)
    except Exception as e:  # noqa: BLE001  a crash is a result to count, not the end of the benchmark
        return {**rec, "status": "crash", "error": f"{type(e).__name__}: {e}", "seconds": time.perf_counter() - t0}
    rec.update(report=res["report"], logprob_a=res["logprob_a"], logprob_b=res["logprob_b"],
               status=res["status"], seconds=time.perf_counter() - t0, layer=res["first_divergent_layer"],
               module=res["culprit_module"], operator=res["first_operator"],
               difference=(res["difference"] or {}).get("kind"),
               repro_exit=(res["repro_check"] or {}).get("exit_code") if res["repro"] else None,
               repro_proves=res["repro_proves"])
    if plant is not None and mode == "plant" and res["repro"]:
        rec.update(_recheck(t, found, undo, out_dir, remove_plant_for_recheck))
    return {**rec, **_judged(res, plant, mode)}
