"""Record kernels launched from Python outside torch's dispatcher (Triton's `kernel[grid](*args)`) as operator calls.

A `@triton.jit` kernel is launched by `JITFunction.run(*args, grid=..., warmup=..., **kwargs)`: no torch
operator is dispatched, so the dispatch-mode recorder (tic.harness.locate.recorder.OpRecorder) sees nothing of e.g.
vLLM's batch-invariant RMSNorm or GEMM. While a recorder is active, every entry point in the registry below is
patched so that each launch becomes one recorded call:
  - inputs: every argument as it was before the launch (tensors copied with their memory layout: a kernel
    addresses memory through pointers and explicit strides, tic.harness.locate.replay.rebuild); a buffer fresh from an
    uninitialised-memory factory (`empty_like`, ...) is recorded as zeros, so two sides' garbage never counts as
    different inputs;
  - outputs: the returned tensors, then every tensor argument whose bits the launch changed (kernels write
    their outputs in place);
  - nothing dispatched inside the launch is recorded separately, and a launch inside a recorded dispatcher op
    (e.g. a Triton GEMM registered as aten::mm's kernel) is part of that op, not a call of its own.
The call's `func` is a `KernelLaunch`: callable in this process (replay), and carrying what a fresh process
needs to launch it again (`launch_spec`: the kernel's import path, the grid resolved to a tuple, which
arguments it writes). The patch is undone when the last recorder exits, whatever happens.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import threading
from dataclasses import dataclass

import torch

from tic.harness.locate.provenance import Provenance
from tic.harness.locate.replay import launch_outputs, rebuild
from tic.harness.locate.trail import OpCall, argument_tokens, recorded_arguments, same_bits, snapshot_tokens


@dataclass(frozen=True)
class LaunchEntry:
    """A Python kernel entry point, called as `<method>(launcher, *args, <grid_kwarg>=..., <warmup_kwarg>=...,
    **kwargs)` like Triton's `JITFunction.run`. `fn_attr` names the launcher's attribute holding the kernel's
    Python function, whose `module:qualname` imports the launcher (or an object reaching it through `fn_attr`
    hops, e.g. a `triton.autotune` wrapper) in a fresh process."""

    module: str
    cls: str
    method: str
    fn_attr: str = "fn"
    grid_kwarg: str = "grid"
    warmup_kwarg: str = "warmup"  # a call with this set compiles only: not a launch


DEFAULT_ENTRIES = (LaunchEntry("triton.runtime.jit", "JITFunction", "run"),)
_entries: list[LaunchEntry] = list(DEFAULT_ENTRIES)


def register(entry: LaunchEntry) -> None:
    if entry not in _entries:
        _entries.append(entry)


def unregister(entry: LaunchEntry) -> None:
    if entry in _entries:
        _entries.remove(entry)


def entries() -> list[LaunchEntry]:
    return list(_entries)


# -- the recorded call ------------------------------------------------------------------------------------
def import_path(path: str):
    module, _, qualname = path.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


class KernelLaunch:
    """One recorded launch as an operator: `KernelLaunch(...)(*args, **kwargs)` launches the kernel again on
    the recorded grid and returns its outputs as recorded (returned tensors, then the written arguments)."""

    is_view = False

    def __init__(self, entry: LaunchEntry, kernel: str, hops: int, grid: tuple, written: tuple,
                 launcher=None, original=None):
        self.entry, self.kernel, self.hops, self.grid, self.written = entry, kernel, hops, grid, written
        self._launcher, self._original = launcher, original  # this process's objects (not pickled)

    def __str__(self) -> str:
        return self.kernel

    __repr__ = __str__

    def __reduce__(self):
        return (KernelLaunch, (self.entry, self.kernel, self.hops, self.grid, self.written))

    @property
    def launch_spec(self) -> dict:
        e = self.entry
        return {"kernel": self.kernel, "hops": self.hops, "fn_attr": e.fn_attr, "method": e.method,
                "grid_kwarg": e.grid_kwarg, "warmup_kwarg": e.warmup_kwarg, "grid": tuple(self.grid),
                "written": tuple(self.written)}

    def __call__(self, *args, **kwargs):
        launcher = self._launcher
        if launcher is None:
            launcher = import_path(self.kernel)
            for _ in range(self.hops):
                launcher = getattr(launcher, self.entry.fn_attr)
        run = self._original or getattr(type(launcher), self.entry.method)
        ret = run(launcher, *args, **{self.entry.grid_kwarg: tuple(self.grid), self.entry.warmup_kwarg: False},
                  **kwargs)
        return tuple(launch_outputs(ret, args, kwargs, self.written))


def _tensors_of(ret) -> list[torch.Tensor]:
    return launch_outputs(ret, (), {}, ())  # Triton returns its compiled kernel: no tensor


def _kernel_path(entry: LaunchEntry, launcher) -> tuple[str, int | None]:
    """The launcher's import path and the `fn_attr` hops from the imported object to it (None: not importable
    by its path, e.g. a kernel defined inside a function: it replays here, but no fresh process can load it)."""
    fn = getattr(launcher, entry.fn_attr)
    path = f"{fn.__module__}:{fn.__qualname__}"
    try:
        obj = import_path(path)
    except (ImportError, AttributeError):
        return path, None
    for hops in range(4):
        if obj is launcher:
            return path, hops
        obj = getattr(obj, entry.fn_attr, None)
    return path, None


def _grid(entry: LaunchEntry, launcher, grid, args, kwargs) -> tuple:
    """The grid as a tuple; a callable grid gets the bound arguments by name, defaults included, as Triton
    calls it (keyword options outside the kernel's signature, e.g. num_warps, are not arguments)."""
    if callable(grid):
        sig = inspect.signature(getattr(launcher, entry.fn_attr))
        bound = sig.bind(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
        bound.apply_defaults()
        grid = grid(dict(bound.arguments))
    return (int(grid),) if isinstance(grid, int) else tuple(int(g) for g in grid)


# -- recording ------------------------------------------------------------------------------------------------
_active: list[tuple] = []  # (recorder (recorder.OpRecorder), its thread id) now recording, innermost last
_patched: list[tuple] = []  # (class, method name, the class's own attribute or None if inherited)


def _record(rec, entry: LaunchEntry, original, launcher, args: tuple, kwargs: dict):
    grid = kwargs.get(entry.grid_kwarg)
    call_kwargs = {k: v for k, v in kwargs.items() if k not in (entry.grid_kwarg, entry.warmup_kwarg)}
    try:
        path, hops = _kernel_path(entry, launcher)
        grid_t = _grid(entry, launcher, grid, args, call_kwargs)
        blank = getattr(rec, "blank", {})
        keys = [(i, a) for i, a in enumerate(args)] + list(call_kwargs.items())
        for _, v in keys:
            if isinstance(v, torch.Tensor) and Provenance._storage_key(v) in blank:
                _poison(v)
        pre_args, pre_kwargs, layouts = recorded_arguments(args, call_kwargs, blank)
        before = {k: rebuild(v) for k, v in keys if isinstance(v, torch.Tensor)}
        sources = (tuple(rec._source(a, before[i]) if i in before else None for i, a in enumerate(args)),
                   {k: rec._source(v, before[k]) if k in before else None for k, v in call_kwargs.items()})
        prov = rec.provenance
        arg_tokens = argument_tokens(prov, args)
    except Exception as e:  # noqa: BLE001  the recording broke, not the launch: launch it plainly
        rec.errors.append(f"launch of {getattr(launcher, entry.fn_attr, launcher)!r}: {type(e).__name__}: {e}")
        return original(launcher, *args, **kwargs)
    ret = original(launcher, *args, **kwargs)
    try:
        written = tuple(k for k, v in keys if isinstance(v, torch.Tensor) and not same_bits(before[k], v))
        func = KernelLaunch(entry, path, hops or 0, grid_t, written, launcher, original)
        returned = _tensors_of(ret)
        written_t = [args[k] if isinstance(k, int) else call_kwargs[k] for k in written]
        outs = launch_outputs(ret, args, call_kwargs, written)
        out_tokens = None
        if prov is not None:
            prov.after(func, args, call_kwargs, returned, written_t)
            out_tokens = tuple(snapshot_tokens(prov.tokens(t)) for t in outs)
        rec.calls.append(OpCall(path, func, pre_args, pre_kwargs, tuple(t.detach().clone() for t in outs), sources,
                                out_tokens, arg_tokens, layouts))
        for k, t in enumerate(outs):
            rec.produced[id(t)] = (len(rec.calls) - 1, k, t)
            blank.pop(Provenance._storage_key(t), None)
        if hops is None:
            rec.errors.append(f"{path}: recorded, but a fresh process cannot import the kernel by this path")
    except Exception as e:  # noqa: BLE001  the launch ran; only its record is lost
        rec.errors.append(f"{path}: launched, not recorded: {type(e).__name__}: {e}")
    return ret


def _poison(t: torch.Tensor) -> None:
    """Fill a buffer nobody has written yet with one fixed byte pattern before a launch: freed memory handed out
    again may already hold exactly the bits the launch writes (the same computation just ran), and a write that
    changes no bit would not be seen. Its contents are undefined anyway, so this changes nothing a kernel may use."""
    if t.dtype == torch.bool or t.numel() == 0:
        return
    pattern = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    pattern.reshape(-1).view(torch.uint8).fill_(0xA5)
    t.copy_(pattern)


def _hooked(entry: LaunchEntry, original):
    def launch(launcher, *args, **kwargs):
        # the innermost recorder of this thread (a dispatch mode is per thread: launches of an engine's other
        # threads are not part of the traced call either)
        rec = next((r for r, tid in reversed(_active) if tid == threading.get_ident()), None)
        if rec is None or rec.busy or kwargs.get(entry.warmup_kwarg):
            return original(launcher, *args, **kwargs)
        # the recorder's own bookkeeping (clones, comparisons) and what the launch dispatches are not operators
        # of the trail: this hook runs outside the mode's handler, so the mode would see them
        rec.busy += 1
        try:
            return _record(rec, entry, original, launcher, args, kwargs)
        finally:
            rec.busy -= 1

    launch._tic_launch_hook = True
    return launch


def attach(recorder) -> None:
    """Start routing launches to `recorder`; the first recorder patches every registered entry point whose module
    is loaded (a kernel of an unloaded module cannot have been defined, so it cannot launch)."""
    _active.append((recorder, threading.get_ident()))
    if len(_active) > 1:
        return
    for entry in _entries:
        mod = sys.modules.get(entry.module)
        cls = getattr(mod, entry.cls, None) if mod is not None else None
        if cls is None:
            continue
        original = getattr(cls, entry.method)
        if getattr(original, "_tic_launch_hook", False):
            continue
        _patched.append((cls, entry.method, cls.__dict__.get(entry.method)))
        setattr(cls, entry.method, _hooked(entry, original))


def detach(recorder) -> None:
    """Stop routing to `recorder`; the last one out restores every patched entry point."""
    _active[:] = [(r, tid) for r, tid in _active if r is not recorder]
    if _active:
        return
    while _patched:
        cls, name, own = _patched.pop()
        if own is None:
            delattr(cls, name)  # it was inherited: uncover the base class's
        else:
            setattr(cls, name, own)
