"""What every engine that deals requests to rank processes shares: the dealing rule, gathering the results back
in request order, and the locator's runner that reruns the compared request on the rank that owns it.

A request's rows never leave its rank (DP only decides where a request runs), so every number a gate compares
comes from one rank, and the locator captures there; the captured operator calls cross back to the calling
process (torch operators pickle by name, arguments bound to the rank process are named instead)."""

from __future__ import annotations

import contextlib
import copyreg
import pickle

import torch


class DealtRequests:
    """Request i of a call runs on rank i % dp (the engine sets `dp` and `pool`, a tic.harness.engines.parallel.RankPool)."""

    dp: int

    def owner_rank(self, index: int) -> int:
        """The DP rank that holds the index-th request of a call (its rows never leave it)."""
        return index % self.dp

    def _deal(self, items: list) -> list[list[int]]:
        return [[i for i in range(len(items)) if self.owner_rank(i) == r] for r in range(self.dp)]

    @staticmethod
    def _gather(shares: list[list[int]], results: list[list], n: int) -> list:
        out: list = [None] * n
        for idx, res in zip(shares, results):
            if len(res) != len(idx):
                raise RuntimeError(f"a rank returned {len(res)} results for {len(idx)} requests")
            for i, x in zip(idx, res):
                out[i] = x
        return out


# -- captures crossing the process boundary ------------------------------------------------------------------
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


class OwnerRankCaptureRunner:
    """The locator's runner for a ranked engine: the owner of the compared request captures on its own share
    (as it ran it), while the other ranks do what the layout needs of them meanwhile.

    names_fn(state, temperature) -> runner_names(a capture runner) runs on every rank once;
    capture_fn(state, job, *extra) runs on every rank per capture, job = (kind, share, index in share, upto,
    spec, together, temperature) on the owner and None on the others; `_extra()` yields those extra arguments."""

    capture_fn = None
    names_fn = None

    def __init__(self, engine, temperature: float):
        self.engine, self.temperature = engine, temperature
        self._names = engine.pool.call(type(self).names_fn, [(temperature,)] * engine.dp)[0]
        self.repro_setup = self._names["repro_setup"]

    def stages(self) -> list[str]:
        return self._names["stages"]

    def children(self, name: str) -> list[str]:
        return self._names["children"][name]

    def descendants(self, name: str) -> list[str]:
        return [n for n in self._names["names"] if n.startswith(name + ".")]

    def _extra(self):
        return contextlib.nullcontext(())

    def _run(self, kind: str, samples, target: int, upto: int, spec, together: bool):
        shares = self.engine._deal(samples)
        owner = self.engine.owner_rank(target)
        job = (kind, [samples[i] for i in shares[owner]], shares[owner].index(target), upto, spec, together,
               self.temperature)
        with self._extra() as extra:
            args = [(job if r == owner else None, *extra) for r in range(self.engine.dp)]
            return self.engine.pool.call(type(self).capture_fn, args)[owner]

    def decode(self, samples, target, upto, spec, together=False):
        return self._run("decode", samples, target, upto, spec, together)

    def score(self, samples, target, spec):
        return self._run("score", samples, target, 0, spec, False)
