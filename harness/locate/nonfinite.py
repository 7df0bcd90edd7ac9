"""Where a NaN or Inf is made: the first module call, and inside it the first operator, whose output is not finite
while what it was given is.

A non-finite logprob is a failure with no difference to bisect (NaN equals nothing), so the comparison locator
cannot search it. This search runs one side's forward on the failing sequence alone, twice: once with a check on
every module call (children finish before their parents, so the first call caught is the deepest one that made
the NaN), once with the operator recorder (tic.harness.locate.recorder, Triton launches included) inside that call
only. It names what made the value; why is the guide's and the repro's business.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from tic.harness.locate.recorder import OpRecorder


def _tensors(v) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, dict):
        v = list(v.values())
    elif hasattr(v, "to_tuple"):  # transformers' ModelOutput
        v = v.to_tuple()
    return [t for x in v for t in _tensors(x)] if isinstance(v, (list, tuple)) else []


def _finite(values) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in _tensors(values) if t.is_floating_point())


def _module_inputs(args, kwargs) -> tuple:
    return (*args, *kwargs.values())


class _FirstBadCall:
    """Hooks on every module: the name of the first call whose inputs are finite and whose output is not."""

    def __init__(self, model: nn.Module):
        self.model, self.found, self.handles, self.open = model, None, [], []

    def __enter__(self):
        for name, m in self.model.named_modules():
            self.handles.append(m.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self.handles.append(m.register_forward_hook(self._post(name), with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def _pre(self, name):
        def hook(module, args, kwargs):
            self.open.append(_finite(_module_inputs(args, kwargs)))
        return hook

    def _post(self, name):
        def hook(module, args, kwargs, out):
            inputs_finite = self.open.pop() if self.open else True
            if self.found is None and inputs_finite and not _finite(out):
                self.found = (name or "<model>", type(module).__name__)
        return hook


class _RecordInside:
    """The operator recorder active during the first call of one module."""

    def __init__(self, module: nn.Module):
        self.module, self.recorder, self.done, self.handles = module, OpRecorder(), False, []

    def __enter__(self):
        def pre(module, args, kwargs):
            if not self.done:
                self.recorder.__enter__()

        def post(module, args, kwargs, out):
            if not self.done:
                self.done = True
                self.recorder.__exit__(None, None, None)

        self.handles = [self.module.register_forward_pre_hook(pre, with_kwargs=True),
                        self.module.register_forward_hook(post, with_kwargs=True)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        if not self.done:  # the forward broke inside the module
            self.recorder.__exit__(None, None, None)


def first_nonfinite(model: nn.Module, forward: Callable[[], object]) -> dict:
    """`forward()` runs `model` on the failing input. The first module call that made a non-finite value from
    finite inputs, and the first operator inside it with a non-finite output (and whether its arguments were
    finite: if not, the NaN or Inf was in a parameter or buffer the module holds)."""
    with torch.no_grad(), _FirstBadCall(model) as calls:
        forward()
    if calls.found is None:
        return {"status": "no module call made a NaN or Inf on this input alone (the value may come from the "
                          "batch's layout: padding, packing, or another sequence of the batch)"}
    name, cls = calls.found
    module = model if name == "<model>" else model.get_submodule(name)
    with torch.no_grad(), _RecordInside(module) as inside:
        forward()
    ops = inside.recorder.calls
    first = next((i for i, c in enumerate(ops) if not _finite(c.outputs)), None)
    return {"status": "localized", "module": name, "module_class": cls,
            "operator": None if first is None else ops[first].op, "operator_index": first,
            # False: the operator was handed a NaN or Inf the module's inputs did not hold (a parameter, a buffer)
            "operator_arguments_finite": None if first is None else _finite((ops[first].args, ops[first].kwargs)),
            "operators_recorded": len(ops), "record_errors": inside.recorder.errors[:5]}


def locate_nonfinite(ctx, side: str, sequence: int) -> dict:
    """For a gate's NonFiniteLogprob: the search above on the side's model (an engine holding a transformers
    model in this process: hf, on any kernels; not vLLM's) and the failing sequence of the rollout's samples."""
    engines = {"train": ctx.train_engine, "rollout": ctx.rollout_engine}
    engine = engines[side]() if side in engines else None
    model = getattr(engine, "model", None)
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        return {"status": f"not searched: the {side} side holds no transformers model in this process"}
    sample = ctx.rollout_samples()[sequence]
    ids = torch.tensor([sample.ids], device=engine.device)
    found = first_nonfinite(model, lambda: model(input_ids=ids, use_cache=False))
    return {"side": side, "sequence": sequence, **found}
