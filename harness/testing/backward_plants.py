"""Planted wrong backwards for C7's tests and its GPU plant benchmark (benchmarks/gpu/c7_plants.py): one
operator's surrogate gradients changed, or its weights changed between forward and backward, in one wrapped
model; the forward values stay the kernel's, and nothing tells the gates. C7 must catch each by measurement alone.

The plant is an Op of its own in that model's wrappers (tic.harness.kernels.autograd.Ops.table): production
backwards never look for plants.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Callable

import torch
from torch import nn

from tic.harness.kernels.autograd import Op, Ops


@dataclass(frozen=True)
class PlantedOp(Op):
    """An operator whose backward runs `before(weights)` (under no_grad) ahead of its weight check and passes its
    input gradients through `change(tuple) -> tuple` before returning them."""

    change: Callable[[tuple], tuple] | None = None
    before: Callable[[list[torch.Tensor]], None] | None = None

    def input_grads(self, ctx, grads: tuple) -> tuple:
        if self.before is not None:
            with torch.no_grad():
                self.before(ctx.guard.weights)
        out = super().input_grads(ctx, grads)
        return tuple(self.change(out)) if self.change is not None else out


@contextmanager
def planted_fault(model: nn.Module, op: str, grads: Callable[[tuple], tuple] | None = None,
                  before: Callable[[list[torch.Tensor]], None] | None = None):
    """While active, operator `op`'s backward in `model` (on tic's kernel wrappers) runs `before(weights)` ahead of
    its weight check and returns `grads(its input gradients)`; every module of the model sees the plant, no other
    model does."""
    holders = [m for m in model.modules() if isinstance(getattr(m, "_tic_ops", None), Ops)]
    if not holders:
        raise ValueError(f"{type(model).__name__} does not run tic's kernel wrappers: nothing to plant into")
    if op not in holders[0]._tic_ops.table:  # OPS, and a block-FP8 model's fp8_* operators
        raise KeyError(f"no operator {op!r}; operators are {', '.join(holders[0]._tic_ops.table)}")
    old = [m._tic_ops for m in holders]
    planted: dict[int, Ops] = {}  # one planted Ops per Ops the model holds (a module may hold its own)
    for m, ops in zip(holders, old):
        if id(ops) not in planted:
            real = ops.table[op]
            fault = PlantedOp(**{f.name: getattr(real, f.name) for f in fields(Op)}, change=grads, before=before)
            planted[id(ops)] = Ops(ops.provider, ops.backward, {**ops.table, op: fault}, ops.quant)
        m._tic_ops = planted[id(ops)]
    try:
        yield
    finally:
        for m, ops in zip(holders, old):
            m._tic_ops = ops
