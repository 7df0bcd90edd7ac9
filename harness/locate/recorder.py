"""The dispatch-mode recorder: the operator trail of one module call, for every engine.

Every torch operator dispatched while the recorder is active becomes an `OpCall` of the trail
(tic.harness.locate.trail); kernels launched from Python outside the dispatcher (Triton) are recorded by the
launch recorder (tic.harness.locate.launch_record), which this recorder attaches while it is active.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tic.core.errors import raised_at
from tic.harness.locate import launch_record, replay
from tic.harness.locate import provenance as provenance_mod
from tic.harness.locate.provenance import Provenance
from tic.harness.locate.trail import (OpCall, argument_tokens, recorded_arguments, same_bits, snapshot_tokens,
                                      tensors_of)


def _clone(v):
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


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

    def mark_blank(self, out) -> None:
        """The tensors of `out` hold uninitialised memory: output buffers until a recorded call writes them."""
        for t in tensors_of(out):
            if (key := Provenance._storage_key(t)) is not None:
                self.blank[key] = t.untyped_storage()

    def _record(self, func, args, kwargs):
        if str(func) in UNINITIALIZED:  # no computation, and garbage bits: not a value two sides can share
            out = func(*args, **kwargs)
            self.mark_blank(out)
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
            # a view of a buffer nothing has written yet (buf.view(...) of an empty buffer): still blank, and
            # recorded as the zeros a replay's copy of that buffer holds, not as the garbage its bits are here
            still_blank = [not any(t is w for w in written) and Provenance._storage_key(t) in self.blank
                           for t in outs]
            out_tokens = None
            if prov is not None:
                prov.after(func, args, kwargs, returned, written)
                out_tokens = tuple(snapshot_tokens(prov.tokens(t)) for t in outs)
            call = OpCall(str(func), func, pre_args, pre_kwargs,
                          tuple(torch.zeros_like(t) if blank else _clone(t) for t, blank in zip(outs, still_blank)),
                          sources, out_tokens, arg_tokens, layouts)
        except Exception as e:  # noqa: BLE001
            self.errors.append(f"{func}: ran, not recorded: {type(e).__name__}: {e}")
            return out
        ci = len(self.calls)
        for k, t in enumerate(outs):
            self.produced[id(t)] = (ci, k, t)
            if not still_blank[k]:
                self.blank.pop(Provenance._storage_key(t), None)
        self.calls.append(call)
        return out


# torch functions and tensor methods that return uninitialised memory (the Python face of UNINITIALIZED)
UNINITIALIZED_FUNCTIONS = {"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided"}

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
        if getattr(func, "__name__", None) in UNINITIALIZED_FUNCTIONS and not isinstance(func, torch._ops.OpOverload) \
                and not self.parent.busy:  # (a recorded kernel's own scratch is no value of the trail)
            # inside an opened wrapper the dispatch mode never sees the aten factory this calls (vLLM's rms_norm
            # allocates its output with torch.empty, then `_C.rms_norm` writes it): the buffer is blank all the same
            out = func(*args, **kwargs)
            self.parent.mark_blank(out)
            return out
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
