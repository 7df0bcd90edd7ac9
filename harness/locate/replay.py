"""Replaying a recorded operator call as the engine ran it, and saying how two sides' calls differ.

Needs only torch and the standard library: tic records and replays calls with it, and every repro tic emits
carries this file verbatim, so a fresh process replays a call the way the locating process did.
  - memory layout: a recorded argument is kept laid out as the engine's was, with the same shape, strides,
    storage offset and address modulo ALIGN bytes (CPU GEMMs and GPU kernels take other code paths for other
    alignments or strides); `layout_of` reads a tensor's, `rebuild` lays values out that way in fresh memory;
  - a call's outputs: the tensors it returns, then the arguments it writes in place (`outputs_of`);
  - where the traced token's value sits in an output (`pick`);
  - `difference(a, b)`: the kind of difference between two sides' calls for the traced token, and what differs.
"""

import importlib

import torch

ALIGN = 64  # bytes: addresses are kept modulo a cache line (CPU SIMD and GPU vector loads pick their path by less)
MAX_OFFSET = 1 << 16  # elements before a tensor in its storage that a copy keeps (a row deep in a batch: not)

# the kinds of difference between the two sides' calls for one value of the traced token
SAME_ARGUMENTS = "same operator, the traced token's arguments bit-identical, different bits"
ARGUMENTS_DIFFER = "same operator, arguments that differ"
SEQUENCES_DIFFER = "different operator sequences"


# -- memory layout --------------------------------------------------------------------------------------------
def layout_of(t):
    """Where t's elements sit in memory: shape, strides, storage offset and the address modulo ALIGN."""
    try:
        align = t.data_ptr() % ALIGN
    except RuntimeError:  # no storage (e.g. a tensor subclass)
        align = None
    return {"shape": list(t.shape), "stride": list(t.stride()), "offset": int(t.storage_offset()), "align": align}


def _span(shape, stride) -> int:
    """Elements from a tensor's first to its last addressed element (gaps and overlaps included)."""
    if any(n == 0 for n in shape):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, stride))


def rebuild(t, layout=None, zero=False):
    """A copy of t's elements (zeros with `zero`) in fresh memory laid out as `layout` says (t's own by default):
    the same shape and strides (a sliced row's gaps, an expanded dimension's overlap), the storage offset (up to
    MAX_OFFSET elements) and the address modulo ALIGN. `clone()` would make a strided view dense and give any
    copy a freshly aligned address. A tensor of another shape than the layout's (cut down to fewer rows) keeps
    the recorded alignment only."""
    lay = layout or layout_of(t)
    if list(lay["shape"]) != list(t.shape):
        lay = dict(layout_of(t.contiguous()), align=lay["align"])
    shape, stride = tuple(lay["shape"]), tuple(lay["stride"])
    if t.numel() == 0:
        return torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device)
    size = t.element_size()
    lead = lay["offset"] if lay["offset"] <= MAX_OFFSET else 0
    span = _span(shape, stride)
    need = (lead + span) * size
    raw = torch.empty(need + ALIGN, dtype=torch.uint8, device=t.device)
    if zero or lead or span != t.numel():  # bytes no element of t fills: zeros, not the allocator's garbage
        raw.zero_()
    raw = raw.untyped_storage()
    start = 0
    if lay["align"] is not None:
        start = (lay["align"] - raw.data_ptr() - lead * size) % ALIGN
        if start % size:  # an address no element of this size can have: keep the storage's own alignment
            start = 0
    out = torch.empty(0, dtype=t.dtype, device=t.device).set_(raw[start:start + need], lead, shape, stride)
    if not zero:
        src = t.detach().to(out.device)
        try:
            out.copy_(src)
        except RuntimeError:  # overlapping elements (an expanded dimension): write each storage element once
            flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(raw[start:start + need], 0,
                                                                           (need // size,), (1,))
            index = torch.as_strided(torch.arange(need // size, device=t.device), shape, stride, lead)
            flat[index.reshape(-1)] = src.reshape(-1)
    return out


def not_rebuilt(t, layout) -> list:
    """The recorded properties that the copy t does not have (an offset beyond MAX_OFFSET, an address the
    allocator cannot give)."""
    got = layout_of(t)
    return [f"{k} {got[k]} (recorded {layout[k]})" for k in ("shape", "stride", "offset", "align")
            if layout.get(k) is not None and got[k] != layout[k]]


def rebuild_tree(v, layouts):
    """Every tensor of an argument tree (tuples/lists/dicts) rebuilt as its recorded layout; other values as
    they are. A layout marked "blank" is an output buffer nobody had written: zeros."""
    if isinstance(v, torch.Tensor):
        lay = layouts if isinstance(layouts, dict) else None
        return rebuild(v, lay, zero=bool(lay and lay.get("blank")))
    if isinstance(v, (list, tuple)):
        lays = layouts if isinstance(layouts, (list, tuple)) else [None] * len(v)
        return type(v)(rebuild_tree(x, lay) for x, lay in zip(v, lays))
    if isinstance(v, dict):
        lays = layouts if isinstance(layouts, dict) else {}
        return {k: rebuild_tree(x, lays.get(k)) for k, x in v.items()}
    return v


def layout_tree(v, blank=None):
    """The layout of every tensor of an argument tree, shaped like it (None for other values); a tensor for which
    `blank(tensor)` holds (an output buffer nobody has written) is marked "blank"."""
    if isinstance(v, torch.Tensor):
        return dict(layout_of(v), blank=True) if blank is not None and blank(v) else layout_of(v)
    if isinstance(v, (list, tuple)):
        return [layout_tree(x, blank) for x in v]
    if isinstance(v, dict):
        return {k: layout_tree(x, blank) for k, x in v.items()}
    return None


# -- running a call -------------------------------------------------------------------------------------------
def written(op, args, kwargs) -> list:
    """Tensors an operator writes in place by its schema (vLLM's kernels return None and fill `out`)."""
    try:
        schema = op._schema
    except AttributeError:
        return []
    got = []
    for i, a in enumerate(schema.arguments):
        v = args[i] if i < len(args) else kwargs.get(a.name)
        if a.alias_info is not None and a.alias_info.is_write and isinstance(v, torch.Tensor):
            got.append(v)
    return got


def results(op, args, kwargs, ret) -> list:
    """A call's outputs: the tensors it returned, then the arguments it wrote that it did not also return."""
    if isinstance(ret, torch.Tensor):
        out = [ret]
    else:  # a tuple/list of results, None (in-place kernels) or a Python scalar (.item())
        out = [x for x in ret if isinstance(x, torch.Tensor)] if isinstance(ret, (list, tuple)) else []
    return out + [w for w in written(op, args, kwargs) if not any(w is o for o in out)]


def outputs_of(op, args, kwargs) -> list:
    return results(op, args, kwargs, op(*args, **kwargs))


def resolve(name):
    ns, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


def launch(spec, args, kwargs):
    """A kernel launched from Python outside torch's dispatcher (e.g. Triton's kernel[grid](...)): imported by its
    path, launched on the recorded grid; its outputs are what it returns, then the arguments it writes."""
    module, _, qualname = spec["kernel"].partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    for _ in range(spec["hops"]):
        obj = getattr(obj, spec["fn_attr"])
    ret = getattr(obj, spec["method"])(*args, **{spec["grid_kwarg"]: tuple(spec["grid"]), spec["warmup_kwarg"]: False},
                                       **kwargs)
    return launch_outputs(ret, args, kwargs, spec["written"])


def launch_outputs(ret, args, kwargs, written) -> list:
    """A launch's outputs: the tensors it returned (Triton returns its compiled kernel: none), then the arguments
    it wrote (`written`: their indices or keywords)."""
    out = [ret] if isinstance(ret, torch.Tensor) else \
        [x for x in ret if isinstance(x, torch.Tensor)] if isinstance(ret, (list, tuple)) else []
    for key in written:
        x = args[key] if isinstance(key, int) else kwargs[key]
        if not any(x is o for o in out):
            out.append(x)
    return out


def run_call(call, args, kwargs):
    if call.get("launch"):
        return launch(call["launch"], args, kwargs)
    return outputs_of(resolve(call["op"]), args, kwargs)


def pick(out, where):
    """The traced token's value in a call's outputs."""
    t = out[where["output"]]
    if where["kind"] == "whole":
        return t
    if where["kind"] == "mask":  # the traced token's elements, found by data
        return t[where["mask"].to(t.device)]
    if where["kind"] == "bt":
        return t[where["b"], where["t"]]
    if where["kind"] == "bht":
        return t[where["b"], :, where["t"]]
    return t[where["row"]]


def dense(t):
    """t's elements in a fresh 1-D buffer of stride 1. `contiguous()` is not enough: a tensor with a size-1
    dimension counts as contiguous whatever that dimension's stride, and reinterpreting its bytes then fails."""
    flat = torch.empty(t.numel(), dtype=t.dtype, device=t.device)
    flat.copy_(t.reshape(-1))
    return flat


_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(t):
    """t's elements (dense) as integers of their size: equal integers are equal bits (-0.0 is not 0.0, NaN
    payloads count)."""
    ints = _INTS.get(t.element_size())
    return dense(t).view(ints) if ints is not None else dense(t)


def bytes_of(t) -> bytes:
    """Every byte of t's elements in row-major order, for any shape, strides, dtype and device."""
    return dense(t.detach().cpu()).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def same_value(x, y) -> bool:
    """The same elements bit for bit, in the same order, of one dtype (in any shape), compared where x lives."""
    if x.dtype != y.dtype or x.numel() != y.numel():
        return False
    return x.numel() == 0 or bool(torch.equal(as_bits(x), as_bits(y.to(x.device))))


def check_replay(got, want, name: str, args=None, layouts=None) -> None:
    """The fresh process must compute what the engine computed, bit for bit, or it is not the same kernel; when it
    does not, say which recorded property of the arguments it could not rebuild, if any."""
    want = want.to(got.device)
    if got.shape == want.shape and same_value(got, want):
        return
    missing = []
    for i, (a, lay) in enumerate(zip(args or (), layouts or ())):
        if isinstance(a, torch.Tensor) and isinstance(lay, dict):
            missing += [f"argument {i}: {m}" for m in not_rebuilt(a, lay)]
    why = ("could not rebuild " + ", ".join(missing)) if missing else (
        f"every argument's shape, strides, storage offset and alignment (mod {ALIGN} bytes) are as recorded: the "
        "kernel depends on something not recorded (the thread count, a process-wide setting, nondeterminism)")
    raise RuntimeError(f"the replay of side {name} does not give the value it recorded: {why}")


# -- what differs between the two sides' calls ----------------------------------------------------------------
def identical(x, y) -> bool:
    """The same Python value, tensors compared by dtype, shape, device and every byte."""
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape \
            and x.device == y.device and same_value(x, y)
    if isinstance(x, (list, tuple)) or isinstance(y, (list, tuple)):
        return isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)) and len(x) == len(y) \
            and all(identical(a, b) for a, b in zip(x, y))
    if isinstance(x, dict) or isinstance(y, dict):
        return isinstance(x, dict) and isinstance(y, dict) and x.keys() == y.keys() \
            and all(identical(x[k], y[k]) for k in x)
    return type(x) is type(y) and x == y


def _dtype(t) -> str:
    return str(t.dtype).replace("torch.", "")


def _first_difference(x, y) -> str:
    """Where two tensors of one dtype and size first differ, in the flat element order."""
    bx, by, size = bytes_of(x), bytes_of(y), x.element_size()
    i = next(i for i in range(0, len(bx), size) if bx[i:i + size] != by[i:i + size]) // size
    return f"first at element {i}: {x.reshape(-1)[i].item()!r} on side A, {y.reshape(-1)[i].item()!r} on side B"


def _value_difference(x, y, what: str) -> str | None:
    if x.dtype != y.dtype:
        return f"{what} is {_dtype(x)} on side A, {_dtype(y)} on side B"
    if x.numel() != y.numel():
        return f"{what} has {x.numel()} elements on side A, {y.numel()} on side B"
    if not same_value(x, y):
        return f"{what} differs ({_first_difference(x, y)})"
    return None


def _argument_difference(u, v, tu, tv) -> str | None:
    """How argument values u (side A) and v (side B) differ for the traced token: `tu`/`tv` are the traced
    token's elements of each (None where the argument holds none of them: a weight, a constant, whose whole value
    then counts)."""
    if isinstance(u, (list, tuple)) and isinstance(v, (list, tuple)):
        if len(u) != len(v):
            return f"{len(u)} tensors on side A, {len(v)} on side B"
        tus = tu if isinstance(tu, (list, tuple)) else [None] * len(u)
        tvs = tv if isinstance(tv, (list, tuple)) else [None] * len(v)
        for j, (a, b, ta, tb) in enumerate(zip(u, v, tus, tvs)):
            how = _argument_difference(a, b, ta, tb)
            if how:
                return f"element {j}: {how}"
        return None
    if isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor):
        if (tu is None) != (tv is None):
            return f"it holds the traced token's values on side {'A' if tv is None else 'B'} only"
        if tu is not None:
            return _value_difference(tu, tv, "the traced token's part")
        if u.shape != v.shape:
            return f"shape {list(u.shape)} on side A, {list(v.shape)} on side B"
        return _value_difference(u, v, "the value")
    if isinstance(u, torch.Tensor) or isinstance(v, torch.Tensor):
        show = lambda x: f"a {_dtype(x)} tensor {list(x.shape)}" if isinstance(x, torch.Tensor) else repr(x)  # noqa: E731
        return f"{show(u)} on side A, {show(v)} on side B"
    return None if type(u) is type(v) and u == v else f"{u!r} on side A, {v!r} on side B"


def argument_names(call) -> list:
    """The schema names of a call's operator's arguments ([] for a launched kernel or an unresolvable operator)."""
    try:
        return [a.name for a in resolve(call["op"])._schema.arguments]
    except Exception:  # noqa: BLE001  a launched kernel, or an operator this process cannot resolve
        return []


def _arguments(call):
    """(key, label, value, traced part, layout) of every argument, positional (key: its index) then keyword."""
    names = argument_names(call)
    tok_args, tok_kwargs = call.get("token_args") or ((None,) * len(call["args"]), {})
    lay_args, lay_kwargs = call.get("layouts") or ((None,) * len(call["args"]), {})
    got = [(i, f"{i} ({names[i]})" if i < len(names) else str(i), v, tok_args[i] if i < len(tok_args) else None,
            lay_args[i] if i < len(lay_args) else None) for i, v in enumerate(call["args"])]
    return got + [(k, k, v, tok_kwargs.get(k), lay_kwargs.get(k)) for k, v in call["kwargs"].items()]


def _tensor_differences(name, u, v, lu, lv) -> list:
    """What differs between two tensors whose traced parts agree: the launch's other rows, its memory layout."""
    if isinstance(u, (list, tuple)) and isinstance(v, (list, tuple)):
        lus = lu if isinstance(lu, (list, tuple)) else [None] * len(u)
        lvs = lv if isinstance(lv, (list, tuple)) else [None] * len(v)
        return [d for j, (a, b, la, lb) in enumerate(zip(u, v, lus, lvs))
                for d in _tensor_differences(f"{name}[{j}]", a, b, la, lb)]
    if not (isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor)):
        return []
    out = []
    if u.shape != v.shape:
        rows = f" ({u.shape[0]} vs {v.shape[0]} rows)" if u.dim() and u.shape[1:] == v.shape[1:] else ""
        out.append(f"argument {name}'s shape {list(u.shape)} vs {list(v.shape)}{rows}")
    elif not same_value(u, v) and not (_blank(lu) or _blank(lv)):
        out.append(f"the values of argument {name} outside the traced token's elements")
    lu, lv = lu or layout_of(u), lv or layout_of(v)
    for key, what in (("stride", "strides"), ("offset", "storage offset"), ("align", f"address mod {ALIGN} bytes")):
        if lu.get(key) != lv.get(key) and not (key == "stride" and u.shape != v.shape and u.is_contiguous()
                                               and v.is_contiguous()):
            out.append(f"argument {name}'s {what} {lu.get(key)} vs {lv.get(key)}")
    return out


def difference(a, b) -> dict:
    """The kind of difference between side A's and side B's computation of the traced token's value, and what
    differs: {"kind", "detail", "argument" (the first differing argument: its index, or keyword), "differs_in"}.

    Operator entries ("op", "args", "kwargs", "where", and optionally "launch", "token_args", "layouts"):
      - the same operator with every argument identical for the traced token (its elements of each traced
        argument; every other argument whole) but different bits: SAME_ARGUMENTS, naming what else differs
        between the two calls (the launch's other rows or shape, strides, storage offset, alignment, grid), or
        saying that they are identical in every recorded property (kernel nondeterminism or unseen state);
      - the same operator with an argument that differs for the traced token: ARGUMENTS_DIFFER, naming the first;
      - otherwise (no operator on side A, another operator, or whole modules' operator sequences):
        SEQUENCES_DIFFER."""
    def verdict(kind, detail, argument=None, differs_in=()):
        return {"kind": kind, "detail": detail, "argument": argument, "differs_in": list(differs_in)}

    for missing, other, call in (("A", "B", a), ("B", "A", b)):
        if call is None:
            return verdict(SEQUENCES_DIFFER, f"side {missing} has no such operator (its value is side {other}'s input)")
    if "calls" in a or "calls" in b:
        return verdict(SEQUENCES_DIFFER, "the two sides compute the module with different operator sequences")
    if a["op"] != b["op"]:
        return verdict(SEQUENCES_DIFFER, f"operator {a['op']} vs {b['op']}")
    args_a, args_b = _arguments(a), _arguments(b)
    if [k for k, *_ in args_a] != [k for k, *_ in args_b]:
        return verdict(ARGUMENTS_DIFFER, f"{len(args_a)} arguments on side A, {len(args_b)} on side B")
    for (key, name, u, tu, lu), (_, _, v, tv, lv) in zip(args_a, args_b):
        if _blank(lu) or _blank(lv):  # an output buffer: what it held before is no input
            continue
        how = _argument_difference(u, v, tu, tv)
        if how:
            return verdict(ARGUMENTS_DIFFER, f"argument {name}: {how}", key)
    differs = []
    if not identical(a.get("launch"), b.get("launch")):
        differs.append(f"the launch grid {(a.get('launch') or {}).get('grid')} vs {(b.get('launch') or {}).get('grid')}")
    for (_, name, u, _, lu), (_, _, v, _, lv) in zip(args_a, args_b):
        differs += _tensor_differences(name, u, v, lu, lv)
    if not differs and not identical(a["where"], b["where"]):
        differs.append(f"the traced token's place in the output ({_place(a['where'])} vs {_place(b['where'])})")
    if differs:
        return verdict(SAME_ARGUMENTS, "the calls differ in " + "; ".join(differs), None, differs)
    return verdict(SAME_ARGUMENTS, "the two calls are identical in every recorded property (values, shapes, strides, "
                   f"storage offsets, addresses mod {ALIGN} bytes): kernel nondeterminism, or state the recorder "
                   "does not see")


def _blank(layout) -> bool:
    return isinstance(layout, dict) and bool(layout.get("blank"))


def _place(where) -> str:
    return ", ".join(f"{k} {v}" for k, v in where.items() if k not in ("kind", "mask"))


def claim(a, b) -> str:
    """One line: the kind of difference, then what differs."""
    d = difference(a, b)
    return f"{d['kind']}: {d['detail']}"
