"""Which token of a traced forward call each recorded value belongs to, followed by data, not by call order.

Engines and kernels run a module's token rows in any order: one batched call, a loop over rows, a loop over
projections inside a loop over rows, per-head tensors whose first dimension happens to equal the row count.
Attributing an operator call to a token by its position in the call sequence or by its shape is then wrong.
Here every storage a recorded value lives in carries a token map (one int per element: the token's flat
index b * T + t in the traced call, -1 for none), so that
  - a view (slice, select, split, transpose, reshape) reads its tokens from the storage it shares,
  - an in-place write (copy_, an `out=` kernel) writes its source's tokens into the written elements,
  - a computed value takes its tokens from its inputs (same shape: element by element; same leading shape:
    per leading index; one token among all inputs: that token; cat/stack: piece by piece).
Seeds are the module's per-token inputs. Weights and buffers carry no tokens.
"""

from __future__ import annotations

import math

import torch

from tic.harness.kernels import stand_ins

# a map covers at most this many elements of a storage: the part its tensors use (a persistent buffer sized for
# the largest batch maps the rows a step fills); a tensor spanning more (a whole KV cache) gets no map, which
# would cost more memory than the trail. Real shapes' activations fit (4k tokens x a 24k-wide gate_up GEMM).
MAX_STORAGE_ELEMENTS = 1 << 27


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The storage elements [first, last + 1) that t's elements lie in."""
    lo = t.storage_offset()
    if t.numel() == 0:
        return lo, lo
    return lo, lo + 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if st > 0)


def _tensors(v) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [x for x in v if isinstance(x, torch.Tensor)]
    return []


def _token_layout(x: torch.Tensor, batch: int, length: int) -> str | None:
    """How a tensor holds tokens: "bt" [B, T, ...], "flat" [B*T, ...], "bht" per head [B, H, T, ...] (attention's
    q/k/v after their transpose), or None. When H == T the two 4-d layouts look alike: a transposed view (the head
    dimension's stride below the token dimension's) is taken per head. For T == 1 a token's elements are the same,
    in the same order, whichever layout is taken. A bool tensor is a mask over another axis (an attention mask's
    keys, placed by the layout's padding): never a token's values."""
    if x.dtype == torch.bool:
        return None
    shape, stride = tuple(x.shape), x.stride()
    per_head = len(shape) >= 3 and shape[0] == batch and shape[2] == length
    if len(shape) >= 2 and shape[:2] == (batch, length) and not (per_head and length > 1 and stride[1] < stride[2]):
        return "bt"
    if len(shape) >= 1 and shape[0] == batch * length:
        return "flat"
    return "bht" if per_head else None


def _as_layout(x: torch.Tensor, layout: str | None, batch: int, length: int) -> torch.Tensor | None:
    if layout == "bt":
        return x
    if layout == "flat":
        return x.unflatten(0, (batch, length))
    return x.transpose(1, 2) if layout == "bht" else None


def token_view(x: torch.Tensor, batch: int, length: int) -> torch.Tensor | None:
    """x as a [B, T, ...] view when it is laid out per token (one of the layouts above); None otherwise."""
    return _as_layout(x, _token_layout(x, batch, length), batch, length)


def standard_map(x: torch.Tensor, batch: int, length: int) -> torch.Tensor | None:
    """Token map of a tensor laid out per token (token_view); None if it is not."""
    m = torch.full(tuple(x.shape), -1, dtype=torch.int32)
    v = _as_layout(m, _token_layout(x, batch, length), batch, length)
    if v is None:
        return None
    v.copy_(torch.arange(batch * length, dtype=torch.int32).reshape(batch, length, *([1] * (v.dim() - 2)))
            .expand(v.shape))
    return m


# the provenances of the trails being recorded now (tic.harness.locate.recorder.OpRecorder pushes and pops its own):
# the kernels' stand-in channel, so that kernel code can hand them values standing for a module's input
ACTIVE = stand_ins.LISTENERS


class Provenance:
    def __init__(self, batch: int, length: int):
        self.batch, self.length = batch, length
        # storage -> (map of its elements [start, start + len(map)), element size, the storage, start)
        self.maps: dict[tuple, tuple[torch.Tensor, int, torch.UntypedStorage, int]] = {}

    @staticmethod
    def _storage_key(t: torch.Tensor) -> tuple | None:
        try:
            return str(t.device), t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. some subclasses)
            return None

    def tokens(self, t: torch.Tensor) -> torch.Tensor | None:
        """The token of each element of t (int32, t's shape, on CPU), or None if its storage has no map."""
        key = self._storage_key(t)
        got = self.maps.get(key) if key else None
        if got is None or got[1] != t.element_size():
            return None
        lo, hi = _extent(t)
        if lo < got[3] or hi > got[3] + got[0].numel():
            return None  # outside the part of the storage the map covers: no token known there
        try:
            return torch.as_strided(got[0], tuple(t.shape), tuple(t.stride()), lo - got[3])
        except RuntimeError:
            return None

    def _covering(self, key: tuple, t: torch.Tensor):
        """The map entry of t's storage, grown to cover t's elements (a new one if it has none); None when that
        would span more than MAX_STORAGE_ELEMENTS."""
        lo, hi = _extent(t)
        got = self.maps.get(key)
        if got is not None and got[1] == t.element_size():
            start, end = got[3], got[3] + got[0].numel()
            if start <= lo and hi <= end:
                return got
            lo, hi = min(lo, start), max(hi, end)
        else:
            got = None
        n = t.untyped_storage().nbytes() // t.element_size()
        if n <= MAX_STORAGE_ELEMENTS:  # small storages: the whole of it, so later views never need a regrowth
            lo, hi = 0, n
        if hi - lo > MAX_STORAGE_ELEMENTS:
            return None
        m = torch.full((hi - lo,), -1, dtype=torch.int32)
        if got is not None:
            m[got[3] - lo: got[3] - lo + got[0].numel()] = got[0]
        # the storage is held so that its address is not reused by another tensor while recording
        self.maps[key] = (m, t.element_size(), t.untyped_storage(), lo)
        return self.maps[key]

    def _set(self, t: torch.Tensor, m: torch.Tensor) -> None:
        key = self._storage_key(t)
        got = self._covering(key, t) if key is not None else None
        if got is None:
            return
        try:
            torch.as_strided(got[0], tuple(t.shape), tuple(t.stride()), t.storage_offset() - got[3]).copy_(m)
        except RuntimeError:  # overlapping elements (an expanded tensor): leave its map as it was
            pass

    def stand_in(self, x: torch.Tensor, values) -> None:
        """For kernel code that computes a module from values standing in for its input `x` (e.g. the two
        addends x was summed from, kept aside by the previous layer; tic.harness.kernels.stand_ins): those values
        carry x's tokens, as x's own views would. Values of another shape, or with tokens already, are left
        alone."""
        m = self.tokens(x)
        if m is None:
            return
        for v in values:
            if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(x.shape) and self.tokens(v) is None:
                self._set(v, m.clone())

    def seed(self, t) -> None:
        """A module input: per-token layouts get the standard map; other tensors (masks, weights) none."""
        for x in _tensors(t):
            m = standard_map(x, self.batch, self.length)
            if m is not None and self.tokens(x) is None:
                self._set(x, m)

    def derived(self, sources: list[torch.Tensor], shape: tuple) -> torch.Tensor | None:
        """The token map of a value of `shape` computed from `sources` (see the module docstring)."""
        maps = [(s, m) for s in sources if (m := self.tokens(s)) is not None and bool((m >= 0).any())]
        if not maps:
            return None
        same = [m for s, m in maps if tuple(s.shape) == tuple(shape)]
        if same:  # element-wise: each output element belongs to the token of the same input element
            out = same[0].clone()
            for m in same[1:]:
                out[out != m] = -1
            return out
        constant = {int(m.flatten()[0]) for _, m in maps if bool((m == m.flatten()[0]).all())}
        if len(constant) == 1 and all(bool((m == m.flatten()[0]).all()) for _, m in maps):
            return torch.full(shape, constant.pop(), dtype=torch.int32)  # one token's values only
        for s, m in maps:  # a row-wise projection or reduction: [.., D] -> [.., E], tokens per leading index
            if s.dim() == len(shape) and s.dim() >= 1 and tuple(s.shape[:-1]) == tuple(shape[:-1]) and \
                    bool((m == m[..., :1]).all()):
                return m[..., :1].expand(shape).clone()
        for s, m in maps:  # a lookup: [B, T] indices -> [B, T, D] rows (embeddings, a cos/sin table)
            if s.dim() < len(shape) and tuple(s.shape) == tuple(shape[:s.dim()]):
                return m.reshape(*s.shape, *([1] * (len(shape) - s.dim()))).expand(shape).clone()
        for s, m in maps:  # an input broadcast to the output
            try:
                return m.expand(shape).clone()
            except RuntimeError:
                continue
        return None

    def after(self, func, args, kwargs, outs: list[torch.Tensor], written: list[torch.Tensor]) -> None:
        """Update the maps for one operator call: its new outputs and the tensors it wrote in place."""
        inputs = [x for v in list(args) + list(kwargs.values()) for x in _tensors(v)]
        if str(func) in CONSTANT_OPS or _op_name(func) in POSITION_OPS:  # no token, whatever was there
            for t in outs + written:
                if self.tokens(t) is not None:
                    self._set(t, torch.full(tuple(t.shape), -1, dtype=torch.int32))
            return
        is_view = bool(getattr(func, "is_view", False))
        dim = _dim_of(func, args, kwargs)
        for o in outs:
            if is_view and any(self._storage_key(o) == self._storage_key(i) for i in inputs):
                continue  # shares its input's storage: its tokens are already there
            if any(o is w for w in written):
                continue
            m = self._moved(func, args, kwargs, tuple(o.shape)) if _is_move(func) else None
            if m is None and _op_name(func) in REDUCTIONS:
                m = self._reduced(func, args, kwargs, tuple(o.shape))
            if m is None:
                m = self._derive(func, [i for i in inputs if i is not o], tuple(o.shape), dim)
            if m is not None:
                self._set(o, m)
        for w in written:
            moved = self._moved(func, args, kwargs, tuple(w.shape)) if _is_move(func) else None
            if moved is not None:  # the written buffer's old tokens took part as the op's `self`
                self._set(w, moved)
                continue
            srcs = [i for i in inputs if i is not w]
            m = self._derive(func, srcs, tuple(w.shape), dim)
            if m is None:
                continue
            old = self.tokens(w)
            if old is not None and not _is_copy(func):  # accumulating writes (add_): keep agreeing tokens
                m = torch.where(old == m, m, torch.where(old < 0, m, torch.full_like(m, -1)))
            self._set(w, m)

    def _moved(self, func, args, kwargs, shape) -> torch.Tensor | None:
        """For an aten operator that only moves elements (a gather by index, a scatter, a pad): the same operator
        run on its data arguments' token maps, shifted by one so that a filled or untouched element (0) comes out
        as -1 (none); index and mask arguments go along as copies on the CPU. This follows a varlen kernel's
        packed rows (`x[index]`) and their scatter back (`out.index_put_(index, rows)`). An element that several
        sources reach (`accumulate=True`, scatter_add, a scatter reduction) keeps a token only if all of them,
        the buffer's own old value included, are that token. None when no data argument has tokens, for an
        `out=` overload (running it would write into the real output), or when the maps cannot take the call."""
        schema = func._schema
        if any(a.alias_info is not None and a.alias_info.is_write and a.name not in DATA_ARGS
               for a in schema.arguments):
            return None
        names = [a.name for a in schema.arguments]
        bound = dict(zip(names, args), **kwargs)
        data = [x for n, v in bound.items() if n in DATA_ARGS for x in _tensors(v)]
        maps = [self.tokens(x) for x in data]
        if not any(m is not None and bool((m >= 0).any()) for m in maps):
            return None  # nothing traced moves: decided before any map is built (a weight may be huge)
        if any(x.numel() > MAX_STORAGE_ELEMENTS for x in data) or math.prod(shape) > MAX_STORAGE_ELEMENTS:
            return None  # as for storages: a whole KV cache gets no map
        reduces = _op_name(func) in SUMMING_OPS or bool(bound.get("accumulate")) or bound.get("reduce") is not None
        summed = "sum" if _op_name(func).startswith("scatter_reduce") else "add"

        def run(of_shifted):
            def as_map(name, v):
                if name == "value" and not isinstance(v, torch.Tensor):
                    return 0  # a fill value, in map terms: no token
                if name == "reduce" and isinstance(v, str):
                    return summed  # which sources meet is what counts: sum them
                if not isinstance(v, torch.Tensor):
                    return [as_map(name, x) for x in v] if isinstance(v, (list, tuple)) else v
                if name not in DATA_ARGS:
                    return v.detach().to("cpu", copy=True)  # an index or a mask: used as it is
                m = self.tokens(v)
                return of_shifted(torch.zeros(tuple(v.shape), dtype=torch.int64) if m is None
                                  else m.to(torch.int64) + 1)

            out = func(*[as_map(n, v) for n, v in zip(names, args)], **{k: as_map(k, v) for k, v in kwargs.items()})
            out = out[0] if isinstance(out, (list, tuple)) else out
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(shape):
                raise ValueError("the maps' result does not have the output's shape")
            return out

        try:
            total = run(lambda m: m)
            if not reduces:
                return (total - 1).to(torch.int32)
            count, squares = run(lambda m: (m > 0).to(torch.int64)), run(lambda m: m * m)
        except Exception:  # noqa: BLE001  an argument form the maps cannot take: fall back to the shape rules
            return None
        # n sources with shifted ids s_i agree iff (sum s_i)^2 == n * sum s_i^2
        agree = (count > 0) & (total * total == count * squares)
        return torch.where(agree, total // count.clamp(min=1) - 1, torch.full_like(total, -1)).to(torch.int32)

    def _reduced(self, func, args, kwargs, shape) -> torch.Tensor | None:
        """For an aten reduction over some dimensions (a sum over an MoE token's top-k slots, a mean over a row
        without keepdim): an output element is a token's when every element it reduces is that token's."""
        try:
            names = [a.name for a in func._schema.arguments]
        except AttributeError:
            return None
        bound = dict(zip(names, args), **kwargs)
        x = bound.get("self", bound.get("input"))
        m = self.tokens(x) if isinstance(x, torch.Tensor) else None
        if m is None or not bool((m >= 0).any()) or m.dim() == 0:
            return None
        dims = bound.get("dim")
        dims = list(range(m.dim())) if dims is None or dims == [] else [dims] if isinstance(dims, int) else list(dims)
        keep = bool(bound.get("keepdim", False))
        ids = m.to(torch.int64) + 1  # 0: no token
        total, count = ids.sum(dims, keepdim=keep), (ids > 0).sum(dims, keepdim=keep)
        squares, n = (ids * ids).sum(dims, keepdim=keep), math.prod(m.shape[d] for d in dims)
        if tuple(total.shape) != tuple(shape):
            return None
        # n ids equal iff none is 0 and (sum ids)^2 == n * sum ids^2
        agree = (count == n) & (total * total == count * squares)
        return torch.where(agree, total // max(n, 1) - 1, torch.full_like(total, -1)).to(torch.int32)

    def _derive(self, func, sources, shape, dim):
        name = _op_name(func)
        if name in ("cat", "stack", "concat", "concatenate"):
            tensors = sources
            parts = []
            for s in tensors:
                m = self.tokens(s)
                parts.append(m.clone() if m is not None else torch.full(tuple(s.shape), -1, dtype=torch.int32))
            try:
                out = torch.stack(parts, dim) if name == "stack" else torch.cat(parts, dim)
            except RuntimeError:
                return None
            return out if tuple(out.shape) == tuple(shape) else None
        return self.derived(sources, shape)


# aten operators that move elements without arithmetic, whose token maps come from running them on the maps
MOVE_OPS = {"index", "_unsafe_index", "index_select", "gather", "take", "index_put", "index_put_", "_index_put_impl_",
            "scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_", "index_add",
            "index_add_", "constant_pad_nd", "flip", "roll", "repeat", "narrow_copy", "masked_scatter",
            "masked_scatter_", "index_copy", "index_copy_"}
# those of them that combine several sources into one element whatever their arguments
SUMMING_OPS = {"scatter_add", "scatter_add_", "index_add", "index_add_", "scatter_reduce", "scatter_reduce_"}


def _is_move(func) -> bool:
    return getattr(func, "namespace", None) == "aten" and _op_name(func) in MOVE_OPS and hasattr(func, "_schema")


# aten reductions over dimensions, whose results belong to a token when all they reduce does
REDUCTIONS = {"sum", "mean", "amax", "amin", "prod", "max", "min", "var", "std", "var_mean", "std_mean", "norm",
              "linalg_vector_norm", "logsumexp", "nansum", "nanmean", "any", "all", "argmax", "argmin"}

# operators whose results take only a shape (and dtype, device) from their tensor inputs: filled buffers
CONSTANT_OPS = {f"aten.{n}.default" for n in ("zeros_like", "ones_like", "full_like", "empty_like", "new_zeros",
                                              "new_ones", "new_full", "new_empty", "new_empty_strided", "zero_")}
CONSTANT_OPS.add("aten.fill_.Scalar")
# operators whose results are coordinates in their input's layout (where a mask is set: a padded row's keys sit
# elsewhere in another layout), not values of the token
POSITION_OPS = {"nonzero", "nonzero_static", "argwhere"}


def _op_name(func) -> str:
    """aten.index_put_.default -> index_put_ (the operator's name without namespace and overload)."""
    return str(func).split(".")[1] if str(func).count(".") >= 2 else str(func)


# the arguments of those operators whose elements move (the rest are indices, masks, sizes)
DATA_ARGS = {"self", "values", "src", "source", "input"}


def _is_copy(func) -> bool:
    return str(func).split(".")[1:2] == ["copy_"] if str(func).count(".") else False


def _dim_of(func, args, kwargs) -> int:
    """The `dim` argument of cat/stack (positional or keyword), 0 by default."""
    if "dim" in kwargs:
        return int(kwargs["dim"])
    if len(args) >= 2 and isinstance(args[1], int):
        return int(args[1])
    return 0
