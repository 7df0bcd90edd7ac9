"""Capture per-module rows of one compared sequence, in whatever batch layout an engine runs it.

Every hooked tensor is normalised to per-token rows keyed by the token's position in the compared sequence,
so a decode batch (left padding, one token per step), a right-padded micro-batch and a packed row all line up
by position. Only the compared sequence's rows are kept; batch-mates and padding are run but not stored.

Engine interface (`CaptureRunner`): an engine that wants localisation supplies
  - `stages()`: ordered stable names compared first (embeddings, rotary, decoder layers, final norm, head);
  - `children(name)`: the stable names of a stage's submodules (norms, projections, attention, router, ...);
  - `decode(samples, target, upto, spec, together=False)`: teacher-forced decode of the target's batch;
  - `score(samples, target, spec)`: the engine's teacher-forced scoring layout for the target's micro-batch.
Both runs return a `Capture`. The HF implementation is `HFCaptureRunner`; an engine may expose its own via a
`capture_runner()` method (e.g. vLLM, whose decoder layers return the residual separately: its runner
maps stable names to its modules and adds residual + hidden in `module_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tic.core.errors import raised_at
from tic.harness.locate import launch_record, replay
from tic.harness.engines.base import Sample
from tic.harness.engines.hf import cache_kwargs, packed_row, padded_batch
from tic.harness.locate import provenance as provenance_mod
from tic.harness.locate.provenance import Provenance, token_view

RowTensors = tuple  # one tensor per row-shaped output (or input) of a module, for one token


@dataclass
class CaptureSpec:
    """What one run records or changes."""

    outputs: set[str] = field(default_factory=set)  # stable names whose output rows are kept
    inputs: set[str] = field(default_factory=set)  # stable names whose input rows are kept
    replace: dict[str, dict[int, RowTensors]] = field(default_factory=dict)  # name -> pos -> input rows
    trail_module: str | None = None  # record the operator sequence inside this module ...
    trail_position: int | None = None  # ... during the forward call that computes this position


@dataclass
class OpCall:
    op: str  # e.g. "aten.mm.default"
    func: object
    args: tuple
    kwargs: dict
    outputs: tuple  # tensor outputs, in order
    # where each tensor argument came from, shaped like (args, kwargs): (call index, output index) of an earlier
    # call of the same trail, or None for a value from outside (weights, module inputs, buffers). Lets a repro
    # replay a whole module's operator sequence as a program.
    sources: tuple | None = None
    # the token map (tic.harness.locate.provenance) of each output and of each top-level argument at call time: which
    # token of the traced forward call each element belongs to, -1 for none; None where nothing is known
    out_tokens: tuple | None = None
    arg_tokens: tuple | None = None  # a tuple per list argument (cat, stack: one map per tensor)
    # where each tensor argument lay in memory when the engine called the operator (tic.harness.locate.replay.layout_of),
    # shaped like (args, kwargs); the recorded arguments are copies laid out the same way
    layouts: tuple | None = None


@dataclass
class Trail:
    calls: list[OpCall]
    batch: int  # B of the recorded forward call
    length: int  # T of the recorded forward call
    flat_index: int  # b * T + t of the traced position inside that call
    errors: list[str] = field(default_factory=list)  # what the recorder could not record as asked


@dataclass
class Capture:
    outputs: dict[str, dict[int, RowTensors]] = field(default_factory=dict)
    inputs: dict[str, dict[int, RowTensors]] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)  # stable names in first-execution order
    logprobs: dict[int, torch.Tensor] = field(default_factory=dict)  # response position -> logprob
    forwards: int = 0
    trail: Trail | None = None


class CaptureRunner(Protocol):
    def stages(self) -> list[str]: ...

    def children(self, name: str) -> list[str]: ...

    def descendants(self, name: str) -> list[str]: ...

    def decode(self, samples: list[Sample], target: int, upto: int, spec: CaptureSpec,
               together: bool = False) -> Capture: ...

    def score(self, samples: list[Sample], target: int, spec: CaptureSpec) -> Capture: ...


# -- row extraction ---------------------------------------------------------------------------------------
def row_shaped(x, batch: int, length: int) -> bool:
    return isinstance(x, torch.Tensor) and token_view(x, batch, length) is not None


def tensors_of(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    if hasattr(out, "to_tuple"):  # transformers ModelOutput
        return [t for t in out.to_tuple() if isinstance(t, torch.Tensor)]
    return []


dense, raw_bytes = replay.dense, replay.bytes_of


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact equality of dtype, shape and every bit (so -0.0 != 0.0 and NaN payloads count), any strides."""
    return a.shape == b.shape and replay.same_value(a, b)


def rows_equal(a: RowTensors, b: RowTensors) -> bool:
    """The same elements bit for bit, in the same order, whatever shape each side's layout gives a token's row."""
    return len(a) == len(b) and all(same_bits(x.reshape(-1), y.reshape(-1)) for x, y in zip(a, b))


class _RowMap:
    """Which (b, t) of the current forward call holds which position of the compared sequence (-1: none)."""

    def __init__(self):
        self.map: torch.Tensor | None = None

    def set(self, m: torch.Tensor) -> None:
        self.map = m

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.map.shape)

    def targets(self) -> list[tuple[int, int]]:
        """(flat index, position) of every compared-sequence token in this call."""
        flat = self.map.reshape(-1)
        idx = (flat >= 0).nonzero().flatten().tolist()
        return [(i, int(flat[i])) for i in idx]


def _clone(v):
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def recorded_arguments(args: tuple, kwargs: dict, blank: dict) -> tuple[tuple, dict, tuple]:
    """(args, kwargs, layouts) as a recorder keeps a call's arguments: copies taken before the call (kernels may
    write their inputs), each tensor laid out in memory as the engine's was (tic.harness.locate.replay.rebuild). A
    buffer fresh from an uninitialised-memory factory and not yet written (its storage in `blank`) is an output
    buffer, not an input: recorded as zeros, its layout marked "blank", so that two sides' garbage never counts
    as different inputs."""
    unwritten = lambda t: Provenance._storage_key(t) in blank  # noqa: E731
    layouts = (tuple(replay.layout_tree(a, unwritten) for a in args),
               {k: replay.layout_tree(v, unwritten) for k, v in kwargs.items()})
    return (tuple(replay.rebuild_tree(a, la) for a, la in zip(args, layouts[0])),
            {k: replay.rebuild_tree(v, layouts[1][k]) for k, v in kwargs.items()}, layouts)


def _snapshot(m: torch.Tensor | None) -> torch.Tensor | None:
    """A token map as it is now (later in-place writes change the storage's map); None if it names no token."""
    return None if m is None or not bool((m >= 0).any()) else m.clone()


def argument_tokens(prov, args: tuple) -> tuple | None:
    """The token map of each top-level argument at call time (a tuple of maps for a list of tensors: cat, stack);
    None without a provenance."""
    if prov is None:
        return None
    one = lambda a: _snapshot(prov.tokens(a)) if isinstance(a, torch.Tensor) else None  # noqa: E731
    return tuple(tuple(one(x) for x in a) if isinstance(a, (list, tuple)) else one(a) for a in args)


class _OpFailed(Exception):
    pass


# Operator namespaces whose ops are Python wrappers over compiled kernels and read per-step state that exists only
# inside the engine's forward (vLLM's attention and KV-cache update take a layer name and look up the step's
# metadata). A repro cannot call them in a fresh process, so the recorder opens them and records the kernels they
# call (e.g. torch.ops._vllm_fa3_C.fwd with its explicit cu_seqlens, page table and KV cache) instead.
OPEN_NAMESPACES: set[str] = {"vllm", "vllm_ir"}  # vllm_ir: kernel chosen by the engine's config

# Factories of uninitialised memory: never recorded (their bits are garbage, no value two sides could share);
# their storages stay `blank` until written, and a launched kernel's copy of a blank buffer is zeros.
UNINITIALIZED = {"aten.empty_like.default", "aten.new_empty.default", "aten.new_empty_strided.default",
                 "aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_permuted.default"}


def _first_tensor(args, kwargs) -> torch.Tensor | None:
    """The first tensor among a call's arguments (one level into lists), or None for a factory call."""
    for v in list(args) + list(kwargs.values()):
        for x in (v if isinstance(v, (list, tuple)) else [v]):
            if isinstance(x, torch.Tensor):
                return x
    return None


class OpRecorder(TorchDispatchMode):
    """Operator trail of one module call, for every engine: inputs copied before the call with their memory layout
    (kernels may mutate them; recorded_arguments), outputs = returned tensors + tensors written in place; factory
    ops (no tensor input: empty, arange, ...) are not computations on the token and are left out. Wrapper ops
    (e.g. vLLM's unified_attention_with_output) of OPEN_NAMESPACES are opened: the kernels they call are
    recorded, not the wrapper. Recording never changes what runs: each operator runs once, as given; a recording
    failure is kept in `errors`."""

    def __init__(self, calls: list | None = None, errors: list | None = None, produced: dict | None = None,
                 provenance=None):
        super().__init__()
        self.provenance = provenance  # tic.harness.locate.provenance.Provenance: tokens of each value, by data
        self.calls: list[OpCall] = calls if calls is not None else []
        self.errors: list[str] = errors if errors is not None else []
        # id(tensor) -> (call index, output index, the tensor): which recorded call last produced or wrote it;
        # the tensor is held so that its id is not reused while recording
        self.produced: dict[int, tuple] = produced if produced is not None else {}
        self.busy = 0  # > 0 while a recorded call runs: what it runs inside is part of it
        # storages fresh from an uninitialised-memory factory and not yet written (their bits are garbage)
        self.blank: dict[tuple, torch.UntypedStorage] = {}

    # kernels launched from Python outside the dispatcher (Triton) are recorded too, while this mode is active;
    # kernel code may hand the provenance values that stand for the module's input (tic.harness.kernels.stand_ins)
    def __enter__(self):
        launch_record.attach(self)
        if self.provenance is not None:
            provenance_mod.ACTIVE.append(self.provenance)
        self._extension_ops = _ExtensionOpRecorder(self)
        try:
            self._extension_ops.__enter__()
            return super().__enter__()
        except BaseException:
            self._detach()
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._detach()

    def _detach(self):
        ext, self._extension_ops = getattr(self, "_extension_ops", None), None
        if ext is not None:
            ext.__exit__(None, None, None)
        launch_record.detach(self)
        if self.provenance is not None and self.provenance in provenance_mod.ACTIVE:
            provenance_mod.ACTIVE.remove(self.provenance)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.busy:  # dispatched inside a recorded launch, or by the launch recorder's own bookkeeping
            return func(*args, **kwargs)
        first = _first_tensor(args, kwargs) if func.namespace in OPEN_NAMESPACES else None
        key = None if first is None else ("CUDA" if first.is_cuda else "CPU")
        if key and torch._C._dispatch_has_computed_kernel_for_dispatch_key(func.name(), key):
            # run the wrapper's own kernel (below the Python-mode key) with the operators it calls recorded as
            # they are called from Python (a function mode: a second trip through Python dispatch breaks some
            # compiled kernels' argument conversion, e.g. FlashAttention 3's); the wrapper itself is not recorded
            n = len(self.calls)
            try:
                with _PythonOpRecorder(self):
                    return func.redispatch(torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key)),
                                           *args, **kwargs)
            except Exception as e:  # noqa: BLE001  e.g. an argument type the boxed call refuses: record it whole
                del self.calls[n:]  # (vLLM's wrappers are idempotent: KV-cache writes, attention into `out`)
                self.errors.append(f"{func}: not opened: {type(e).__name__}: {e} (at {raised_at(e, 4)})")
        return self.record(func, args, kwargs)

    def record(self, func, args, kwargs):
        try:
            return self._record(func, args, kwargs)
        except _OpFailed as e:
            raise e.__cause__ from None
        except Exception as e:  # noqa: BLE001  the recording broke, not the operator: run it plainly
            self.errors.append(f"{func}: {type(e).__name__}: {e}")
            return func(*args, **kwargs)

    def _source(self, v, pre):
        """(call, output) that produced argument v, if its value now is still what that call recorded. A value
        changed since through another view of its storage (vLLM's attention writes a slice of a buffer that
        o_proj then reads whole) enters as a recorded value instead, so a replay never reads a stale one."""
        if isinstance(v, (list, tuple)):
            return type(v)(self._source(x, y) for x, y in zip(v, pre))
        if not isinstance(v, torch.Tensor) or id(v) not in self.produced:
            return None
        ci, k, _ = self.produced[id(v)]
        return (ci, k) if same_bits(self.calls[ci].outputs[k], pre) else None

    def _record(self, func, args, kwargs):
        if str(func) in UNINITIALIZED:  # no computation, and garbage bits: not a value two sides can share
            out = func(*args, **kwargs)
            for t in tensors_of(out):
                if (key := Provenance._storage_key(t)) is not None:
                    self.blank[key] = t.untyped_storage()
            return out
        if _first_tensor(args, kwargs) is None:
            return func(*args, **kwargs)
        pre_args, pre_kwargs, layouts = recorded_arguments(args, kwargs, self.blank)
        sources = (tuple(self._source(a, p) for a, p in zip(args, pre_args)),
                   {k: self._source(v, pre_kwargs[k]) for k, v in kwargs.items()})
        prov = self.provenance
        arg_tokens = argument_tokens(prov, args)
        self.busy += 1
        try:
            out = func(*args, **kwargs)
        except Exception as e:  # the operator itself failed: not a recording problem
            raise _OpFailed() from e
        finally:
            self.busy -= 1
        try:  # the operator ran: from here on a failure loses its record, never reruns it
            returned = tensors_of(out)
            written = replay.written(func, args, kwargs)
            outs = returned + [w for w in written if not any(w is o for o in returned)]
            out_tokens = None
            if prov is not None:
                prov.after(func, args, kwargs, returned, written)
                out_tokens = tuple(_snapshot(prov.tokens(t)) for t in outs)
            call = OpCall(str(func), func, pre_args, pre_kwargs, tuple(_clone(t) for t in outs), sources,
                          out_tokens, arg_tokens, layouts)
        except Exception as e:  # noqa: BLE001
            self.errors.append(f"{func}: ran, not recorded: {type(e).__name__}: {e}")
            return out
        ci = len(self.calls)
        for k, t in enumerate(outs):
            self.produced[id(t)] = (ci, k, t)
            self.blank.pop(Provenance._storage_key(t), None)
        self.calls.append(call)
        return out


# Namespaces recorded where the dispatcher sees them: PyTorch's own operators (a Python dispatch mode sees every
# aten op, including those that tensor methods and torch functions call).
DISPATCH_NAMESPACES: set[str] = {"aten", "prims"}


def _overload(func, args=(), kwargs=None):
    """The OpOverload a torch.ops call resolves to (a packet: the overload its arguments select), else None."""
    if isinstance(func, torch._ops.OpOverloadPacket):
        names = func.overloads()
        if len(names) == 1:
            return getattr(func, names[0])
        try:
            return getattr(func, torch._C._jit_resolve_packet(func._qualified_op_name, *args, **(kwargs or {})))
        except Exception:  # noqa: BLE001  no overload takes these arguments: the call itself will say so
            return None
    return func if isinstance(func, torch._ops.OpOverload) else None


class _PythonOpRecorder(TorchFunctionMode):
    """Inside an opened wrapper: records each torch.ops operator as Python calls it, into the parent recorder.
    Tensor methods and torch functions run unrecorded (their results enter as recorded values from outside)."""

    def __init__(self, parent: OpRecorder):
        super().__init__()
        self.parent = parent

    def takes(self, op) -> bool:
        return True

    def record(self, op, args, kwargs):
        return self.parent.record(op, args, kwargs)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = _overload(func, args, kwargs)
        if op is None or not self.takes(op):
            return func(*args, **kwargs)
        return self.record(op, args, kwargs)


class _ExtensionOpRecorder(_PythonOpRecorder):
    """Records extension operators (torch.ops of a compiled library: vLLM's `_C`, FlashAttention 3's
    `_vllm_fa3_C`, ...) as Python calls them, then runs them with the dispatch mode off. A trip through Python
    dispatch boxes a call's arguments and results into Python and back, and some extension kernels refuse what
    comes back: FlashAttention 3's `fwd` in vLLM 0.26 raises "Unable to cast Python instance of type list" under
    a dispatch mode, which broke the locator on a training side that calls it directly. Inside an opened vLLM
    wrapper the dispatch mode is already off, so these ops were recorded the same way there."""

    def takes(self, op) -> bool:
        # aten ops go to the dispatch mode, which sees them next, and so do the wrappers it opens
        return not (self.parent.busy or op.namespace in DISPATCH_NAMESPACES or op.namespace in OPEN_NAMESPACES)

    def record(self, op, args, kwargs):
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            return super().record(op, args, kwargs)


class InputRows(tuple):
    """One token's input rows of a module call, with the argument each came from (`keys`: "0" for the first
    positional argument, "position_embeddings.1" for the second tensor of that keyword): replay substitutes
    each input by the other side's input of the same argument."""

    keys: tuple = ()

    def __new__(cls, rows, keys):
        obj = super().__new__(cls, rows)
        obj.keys = tuple(keys)
        return obj

    def __reduce__(self):  # pickled with its keys (rows recorded on another rank cross a process boundary)
        return (InputRows, (tuple(self), self.keys))


def _input_tensors(args: tuple, kwargs: dict, batch: int, length: int) -> list[tuple[str, torch.Tensor]]:
    """Every token-row tensor input of a call, positional and keyword, one level into tuples/lists (e.g. the
    (cos, sin) of `position_embeddings`), as (key, tensor); positional ones first, then `hidden_states`, so
    that the first is the hidden state whichever way it was passed."""
    found = []

    def visit(key: str, v) -> None:
        if isinstance(v, (list, tuple)):
            for j, x in enumerate(v):
                if row_shaped(x, batch, length):
                    found.append((f"{key}.{j}", x))
        elif row_shaped(v, batch, length):
            found.append((key, v))

    for i, a in enumerate(args):
        visit(str(i), a)
    if "hidden_states" in kwargs:
        visit("hidden_states", kwargs["hidden_states"])
    for k, v in kwargs.items():
        if k != "hidden_states":
            visit(k, v)
    return found


def _set_input(args: list, kwargs: dict, key: str, value: torch.Tensor) -> None:
    head, _, j = key.partition(".")
    holder, name = (args, int(head)) if head.isdigit() else (kwargs, head)
    if j:
        seq = list(holder[name])
        seq[int(j)] = value
        holder[name] = type(holder[name])(seq)
    else:
        holder[name] = value


def _keep(store: dict, views: list[torch.Tensor], targets: list[tuple[int, int]], keys: list[str] | None = None) -> None:
    """store[pos] = the target rows of every per-token tensor (its [B, T, ...] token_view), as CPU copies (engines
    on a GPU compare with CPU ones); with `keys`, as InputRows that name the argument of each row."""
    if not targets:
        return
    for i, pos in targets:
        b, t = divmod(i, views[0].shape[1]) if views else (0, 0)
        rows = tuple(v[b, t].detach().cpu().clone() for v in views)
        store[pos] = rows if keys is None else InputRows(rows, keys)


def _replaced(args: tuple, kwargs: dict, B: int, T: int, targets, repl: dict) -> tuple[tuple, dict]:
    """args/kwargs with the traced sequence's rows of every token-row input replaced by the other side's.

    Rows recorded with their argument keys (InputRows) replace the input of the same argument, whatever it
    is (hidden states, position embeddings, a residual): a module then sees exactly the other side's inputs.
    A row of another shape or dtype family is left as it is (a decode step's mask row is not a prefill's).
    Rows from an engine that records no keys (plain tuples, hidden state first) replace the hidden state only."""
    new_args, new_kwargs = list(args), dict(kwargs)
    for k, (key, x) in enumerate(_input_tensors(args, kwargs, B, T)):
        x = x.clone()
        view = token_view(x, B, T)
        changed = False
        for i, pos in targets:
            got = repl.get(pos)
            if got is None:
                continue
            keys = getattr(got, "keys", None)
            if keys:
                if key not in keys:
                    continue
                row = got[keys.index(key)]
            elif k == 0 and got:
                row = got[0]
            else:
                continue
            here = view[i // T, i % T]
            # the same elements in the same order in another per-token layout (a decode step's [H, 1, D] head
            # rows and a prefill's [H, D]) replace each other
            if row.numel() != here.numel() or row.is_floating_point() != here.is_floating_point():
                continue
            here.copy_(row.reshape(here.shape))
            changed = True
        if changed:
            _set_input(new_args, new_kwargs, key, x)
    return tuple(new_args), new_kwargs


class HookSet:
    """Forward hooks on named modules that keep, or replace, the compared sequence's rows."""

    def __init__(self, modules: dict[str, torch.nn.Module], spec: CaptureSpec, rowmap: _RowMap,
                 module_rows=None):
        self.modules, self.spec, self.rowmap = modules, spec, rowmap
        self.module_rows = module_rows or (lambda name, out: tensors_of(out))
        self.capture = Capture()
        self.handles = []
        self._recorder: OpRecorder | None = None

    def __enter__(self):
        names = set(self.spec.outputs) | set(self.spec.inputs) | set(self.spec.replace)
        if self.spec.trail_module:
            names.add(self.spec.trail_module)
        for name in sorted(names):
            m = self.modules.get(name)
            if m is None:
                continue
            self.handles.append(m.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self.handles.append(m.register_forward_hook(self._post(name), with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        if self._recorder is not None:  # an exception inside the traced call
            self._recorder.__exit__(None, None, None)
            self._recorder = None

    def _pre(self, name):
        def hook(module, args, kwargs):
            B, T = self.rowmap.shape
            targets = self.rowmap.targets()
            if name not in self.capture.order:
                self.capture.order.append(name)
            new_args, new_kwargs = args, kwargs
            if name in self.spec.replace:
                new_args, new_kwargs = _replaced(args, kwargs, B, T, targets, self.spec.replace[name])
            if name in self.spec.inputs:
                store = self.capture.inputs.setdefault(name, {})
                found = _input_tensors(new_args, new_kwargs, B, T)
                _keep(store, [token_view(x, B, T) for _, x in found], targets, [k for k, _ in found])
            # a module called more than once in the forward (Gemma-3's rotary, once per attention kind): its last
            # call is traced, the one whose rows the capture keeps
            if (name == self.spec.trail_module and self._recorder is None
                    and any(pos == self.spec.trail_position for _, pos in targets)):
                fi = next(i for i, pos in targets if pos == self.spec.trail_position)
                self.capture.trail = Trail([], B, T, fi)
                prov = Provenance(B, T)
                for _, x in _input_tensors(new_args, new_kwargs, B, T):
                    prov.seed(x)
                self._recorder = OpRecorder(self.capture.trail.calls, self.capture.trail.errors, provenance=prov)
                self._recorder.__enter__()
            if name in self.spec.replace:
                return new_args, new_kwargs
            return None
        return hook

    def _post(self, name):
        def hook(module, args, kwargs, out):
            if name == self.spec.trail_module and self._recorder is not None:
                self._recorder.__exit__(None, None, None)
                self._recorder = None
            if name not in self.spec.outputs:
                return None
            B, T = self.rowmap.shape
            outs = [v for v in (token_view(t, B, T) for t in self.module_rows(name, out)) if v is not None]
            _keep(self.capture.outputs.setdefault(name, {}), outs, self.rowmap.targets())
            return None
        return hook


# -- the HF implementation --------------------------------------------------------------------------------
class HFCaptureRunner:
    """Runs an HFEngine's two layouts teacher-forced, exactly as its generate/score compute them."""

    def __init__(self, engine, temperature: float = 1.0):
        self.engine = engine
        self.model = engine.model
        self.temperature = temperature
        self.modules = dict(self.model.named_modules())
        self.rowmap = _RowMap()

    # names
    def layer_names(self) -> list[str]:
        return [n for n, m in self.modules.items()
                if n.count(".") == 2 and n.split(".")[-2] == "layers" and n.split(".")[-1].isdigit()]

    def stages(self) -> list[str]:
        layers = self.layer_names()
        prefix = layers[0].rsplit(".", 2)[0] if layers else "model"
        pre = [n for n in (f"{prefix}.embed_tokens", f"{prefix}.rotary_emb") if n in self.modules]
        post = [n for n in (f"{prefix}.norm", "lm_head") if n in self.modules]
        return pre + layers + post

    def children(self, name: str) -> list[str]:
        return [f"{name}.{c}" if name else c for c, _ in self.modules[name].named_children()]

    def descendants(self, name: str) -> list[str]:
        return [n for n in self.modules if n.startswith(name + ".")]

    # runs
    def _hooks(self, spec: CaptureSpec) -> HookSet:
        return HookSet(self.modules, spec, self.rowmap)

    @torch.inference_mode()
    def decode(self, samples, target, upto, spec, together=False) -> Capture:
        from transformers import DynamicCache

        bs = len(samples) if together else self.engine.batch_size
        start = 0 if together else (target // bs) * bs
        batch = samples[start:start + bs]
        tb = target - start
        prompts = [s.prompt_ids for s in batch]
        B, L = len(prompts), max(len(p) for p in prompts)
        dev = self.engine.device
        ids, mask, pos, _ = padded_batch(prompts, "left", dev)  # as HFEngine._generate_batch
        cache = DynamicCache(config=self.model.config)
        P = len(prompts[tb])
        with self._hooks(spec) as hooks:
            step_ids, step_pos = ids, pos
            for step in range(upto + 1):
                rm = torch.full(step_ids.shape, -1, dtype=torch.long)
                if step == 0:
                    rm[tb, L - P:] = torch.arange(P)
                else:
                    rm[tb, 0] = P + step - 1
                self.rowmap.set(rm)
                logits = self.model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos,
                                    **cache_kwargs(self.model, cache), use_cache=True).logits[:, -1]
                hooks.capture.forwards += 1
                lp = self.engine.logprobs_of(logits, self.temperature)
                hooks.capture.logprobs[step] = lp[tb, batch[tb].response_ids[step]].float().cpu().clone()
                nxt = [s.response_ids[step] if step < len(s.response_ids) else 0 for s in batch]
                step_ids = torch.tensor(nxt, dtype=torch.long, device=dev)[:, None]
                step_pos = step_pos[:, -1:] + 1
                mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long, device=dev)], dim=1)
        return hooks.capture

    @torch.inference_mode()
    def score(self, samples, target, spec) -> Capture:
        eng = self.engine
        group = next(g for g in eng.micro_batches(len(samples)) if target in g)  # the forward the engine ran
        chunk = [samples[i] for i in group]
        tb = group.index(target)
        seqs = [s.ids for s in chunk]
        with self._hooks(spec) as hooks:
            if eng.packing:  # the layout of HFEngine._score_packed
                ids, pos, offsets = packed_row(seqs, eng.device)
                off = offsets[tb]
                rm = torch.full(ids.shape, -1, dtype=torch.long)
                rm[0, off:off + len(seqs[tb])] = torch.arange(len(seqs[tb]))
                self.rowmap.set(rm)
                logits = self.model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
            else:  # the layout of HFEngine._score_padded
                ids, mask, pos, starts = padded_batch(seqs, eng.padding_side, eng.device)
                rm = torch.full(ids.shape, -1, dtype=torch.long)
                rm[tb, starts[tb]:starts[tb] + len(seqs[tb])] = torch.arange(len(seqs[tb]))
                self.rowmap.set(rm)
                logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
                off = None
            hooks.capture.forwards += 1
            s = chunk[tb]
            P, R = len(s.prompt_ids), len(s.response_ids)
            rows = logits[off + P - 1: off + P - 1 + R] if eng.packing else \
                logits[tb, starts[tb] + P - 1: starts[tb] + P - 1 + R]
            lp = eng.logprobs_of(rows, self.temperature)
            got = lp[torch.arange(R), torch.tensor(s.response_ids)].float().cpu()
            hooks.capture.logprobs = {j: got[j].clone() for j in range(R)}
        return hooks.capture


def runner_for(engine, temperature: float) -> CaptureRunner:
    """The engine's own capture runner if it has one, else the HF one for HF engines."""
    own = getattr(engine, "capture_runner", None)
    if callable(own):
        return own(temperature)
    from tic.harness.engines.hf import HFEngine

    if isinstance(engine, HFEngine):
        return HFCaptureRunner(engine, temperature)
    from tic.core.errors import TicInputError

    raise TicInputError(f"engine {getattr(engine, 'name', engine)!r} cannot run with capture (no capture_runner)")

