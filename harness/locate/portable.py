"""Captures that cross a process boundary: a ranked engine's owner rank captures, the calling process compares.

Torch operators pickle by name; operator calls holding values bound to the rank process (a process group, a work
handle of the expert exchange) keep their operator and outputs, those values named instead."""

from __future__ import annotations

import copyreg
import pickle

import torch


def _resolve_op(qualified: str, overload: str):
    ns, name = qualified.split("::", 1)
    packet = getattr(getattr(torch.ops, ns), name)
    return getattr(packet, overload or "default")


def _reduce_op(op):
    return _resolve_op, (op._schema.name, op._overloadname)


# operator trails cross the process boundary: torch ops pickle by name
copyreg.pickle(torch._ops.OpOverload, _reduce_op)


def _scrub(v):
    """v with every value that cannot leave this process (a process group, a work handle) named instead."""
    if isinstance(v, (list, tuple)):
        return type(v)(_scrub(x) for x in v)
    if isinstance(v, dict):
        return {k: _scrub(x) for k, x in v.items()}
    try:
        pickle.dumps(v)
        return v
    except Exception:  # noqa: BLE001 - whatever pickling refuses
        return f"<{type(v).__name__} on rank process>"


class ForeignOp:
    """Stands for an operator whose callable cannot leave the rank process (a pybind collective binding)."""

    is_view = False

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.name} ran on a rank process and cannot be rerun here")

    def __repr__(self) -> str:
        return self.name


def portable(cap):
    """A capture the calling process can unpickle: operator calls holding process-bound arguments (the
    collectives of the expert exchange) keep their operator, outputs and a name for those arguments."""
    if cap.trail is not None:
        for c in cap.trail.calls:
            try:
                pickle.dumps(c)
            except Exception:  # noqa: BLE001
                c.args, c.kwargs, c.outputs = _scrub(c.args), _scrub(c.kwargs), _scrub(c.outputs)
                if isinstance(_scrub(c.func), str):
                    c.func = ForeignOp(c.op)
    return cap


def runner_names(runner) -> dict:
    """What the calling process's runner answers from, read once from a capture runner on a rank."""
    names = list(runner.modules)
    return {"stages": runner.stages(), "children": {n: runner.children(n) for n in names}, "names": names,
            "repro_setup": list(getattr(runner, "repro_setup", None) or [])}
