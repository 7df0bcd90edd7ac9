"""An operator trail: the operator calls recorded inside one module call, and what every recorder keeps of a call.

Two recorders write trails: the dispatch-mode recorder (tic.harness.locate.recorder) for torch operators, and the
launch recorder (tic.harness.locate.launch_record) for kernels launched from Python outside the dispatcher. Both
keep a call's arguments the same way (copies taken before the call, laid out in memory as the engine's were) and
its token maps (tic.harness.locate.provenance), through the functions here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tic.harness.locate import replay
from tic.harness.locate.provenance import Provenance


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


def tensors_of(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    if hasattr(out, "to_tuple"):  # transformers ModelOutput
        return [t for t in out.to_tuple() if isinstance(t, torch.Tensor)]
    return []


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact equality of dtype, shape and every bit (so -0.0 != 0.0 and NaN payloads count), any strides."""
    return a.shape == b.shape and replay.same_value(a, b)


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


def snapshot_tokens(m: torch.Tensor | None) -> torch.Tensor | None:
    """A token map as it is now (later in-place writes change the storage's map); None if it names no token."""
    return None if m is None or not bool((m >= 0).any()) else m.clone()


def argument_tokens(prov, args: tuple) -> tuple | None:
    """The token map of each top-level argument at call time (a tuple of maps for a list of tensors: cat, stack);
    None without a provenance."""
    if prov is None:
        return None
    one = lambda a: snapshot_tokens(prov.tokens(a)) if isinstance(a, torch.Tensor) else None  # noqa: E731
    return tuple(tuple(one(x) for x in a) if isinstance(a, (list, tuple)) else one(a) for a in args)
