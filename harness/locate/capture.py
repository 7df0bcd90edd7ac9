"""Capture per-module rows of one compared sequence, in whatever batch layout an engine runs it.

Every hooked tensor is normalised to per-token rows keyed by the token's position in the compared sequence,
so a decode batch (left padding, one token per step), a right-padded micro-batch and a packed row all line up
by position. Only the compared sequence's rows are kept; batch-mates and padding are run but not stored.

Engine interface (`CaptureRunner`): an engine that wants localisation supplies
  - `stages()`: ordered stable names compared first (embeddings, rotary, decoder layers, final norm, head);
  - `children(name)`: the stable names of a stage's submodules (norms, projections, attention, router, ...);
  - `decode(samples, target, upto, spec, together=False)`: teacher-forced decode of the target's batch;
  - `score(samples, target, spec)`: the engine's teacher-forced scoring layout for the target's micro-batch.
Both runs return a `Capture`. The runners are tic.harness.locate.hf_capture (HF engines),
tic.harness.locate.vllm_capture (vLLM, whose decoder layers return the residual separately) and the owner-rank
runner of ranked engines; tic.harness.locate.runners picks one per engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from tic.harness.engines.base import Sample
from tic.harness.locate.provenance import Provenance, token_view
from tic.harness.locate.recorder import OpRecorder
from tic.harness.locate.trail import Trail, same_bits, tensors_of

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
