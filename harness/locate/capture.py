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
from tic.harness.locate.provenance import Provenance
from tic.harness.locate.recorder import OpRecorder
from tic.harness.locate.trail import Trail, same_bits

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


def module_children(modules: dict, name: str) -> list[str]:
    """The names of `name`'s children in a model's named_modules() map. A module shared by several parents (vLLM's
    rotary embedding, one instance per configuration) is listed once, under its first path; its other paths are
    not in the map and are left out here rather than looked up."""
    kids = (f"{name}.{c}" if name else c for c, _ in modules[name].named_children())
    return [k for k in kids if k in modules]


def model_part(modules: dict, prefix: str, usual: str, kind: str) -> str | None:
    """A model-level part under `prefix`: `prefix.usual` (embed_tokens, norm) where it exists, else the first child
    whose class name contains `kind` (Embedding, Norm: Mamba-2's `embeddings` and `norm_f`); None without one."""
    if f"{prefix}.{usual}" in modules:
        return f"{prefix}.{usual}"
    if prefix not in modules:
        return None
    return next((n for n in module_children(modules, prefix) if kind in type(modules[n]).__name__), None)


def rows_equal(a: RowTensors, b: RowTensors) -> bool:
    """The same elements bit for bit, in the same order, whatever shape each side's layout gives a token's row."""
    return len(a) == len(b) and all(same_bits(x.reshape(-1), y.reshape(-1)) for x, y in zip(a, b))


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


def keyed_values(args: tuple, kwargs: dict) -> list[tuple[str, object]]:
    """A call's arguments as (key, value): positional ones ("0", "1", ...) first, then `hidden_states`, then the
    other keywords, so that the first is the hidden state whichever way it was passed."""
    out = [(str(i), a) for i, a in enumerate(args)]
    if "hidden_states" in kwargs:
        out.append(("hidden_states", kwargs["hidden_states"]))
    return out + [(k, v) for k, v in kwargs.items() if k != "hidden_states"]


# -- the row layout: where the compared sequence's tokens are in the forward call now running ---------------
class RowLayout:
    """The strategy the capture mechanism (HookSet) runs over: which token rows of the forward call now running
    hold the compared sequence, and how an engine's module calls carry per-token tensors.

    `map` is the current call's [B, T] map (the compared sequence's position of each token, -1 for batch-mates
    and padding): HF's padded batch or packed row [B, T] (tic.harness.locate.hf_capture.PaddedRows), or one vLLM
    step's flattened varlen tokens as [1, num_tokens] (tic.harness.locate.vllm_capture.FlatRows). The runner
    sets it before each forward (HookSet.step), or, when the engine decides the rows inside its step, a pre-hook
    on `step_module` does, from `step_map`."""

    step_module: str | None = None

    def __init__(self):
        self.map: torch.Tensor | None = None
        self._targets: list[tuple[int, int]] = []

    def set(self, m: torch.Tensor | None) -> None:
        self.map = m
        flat = m.reshape(-1) if m is not None else torch.zeros(0, dtype=torch.long)
        self._targets = [(i, int(flat[i])) for i in (flat >= 0).nonzero().flatten().tolist()]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.map.shape)

    def targets(self) -> list[tuple[int, int]]:
        """(flat index b * T + t, position) of every compared-sequence token in the current call."""
        return self._targets

    def step_map(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """The map of the step whose `step_module` call has these arguments."""
        raise NotImplementedError

    def view(self, x) -> torch.Tensor | None:
        """x as a [B, T, ...] view of per-token rows, or None when x is not laid out per token."""
        raise NotImplementedError

    def inputs(self, module, args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], list[str] | None]:
        """A call's per-token inputs as recorded, and the argument each came from (None: recorded unnamed)."""
        raise NotImplementedError

    def outputs(self, name: str, out) -> list[torch.Tensor]:
        """A call's per-token outputs as compared."""
        raise NotImplementedError

    def replace(self, module, args: tuple, kwargs: dict, repl: dict) -> tuple[tuple, dict]:
        """args/kwargs with the compared tokens' rows of the per-token inputs replaced by recorded rows `repl`."""
        raise NotImplementedError

    def trail_inputs(self, module, args: tuple, kwargs: dict) -> list:
        """The values whose tokens seed a traced call's trail, in a layout tic.harness.locate.provenance knows
        ([B, T, ...], [B * T, ...], per head); tensors of no such layout get no tokens."""
        return [v for _, v in keyed_values(args, kwargs)]


def _keep(store: dict, views: list[torch.Tensor], targets: list[tuple[int, int]], keys: list[str] | None) -> None:
    """store[pos] = the target rows of every per-token view [B, T, ...], as CPU copies (engines on a GPU compare
    with CPU ones; one gather and one transfer per tensor); with `keys`, as InputRows that name the argument of
    each row. A call without per-token tensors keeps an empty row: the module ran on the compared tokens."""
    if not targets:
        return
    got = []
    if views:
        T = views[0].shape[1]
        b = torch.tensor([i // T for i, _ in targets])
        t = torch.tensor([i % T for i, _ in targets])
        got = [v.detach()[b.to(v.device), t.to(v.device)].cpu() for v in views]
    for j, (_, pos) in enumerate(targets):
        rows = tuple(g[j].clone() for g in got)
        store[pos] = rows if keys is None else InputRows(rows, keys)


class HookSet:
    """The capture mechanism, for every engine: forward hooks on named modules that keep, or replace, the compared
    sequence's rows where a RowLayout says they are, and record the operator trail of one module call.

    A module called more than once in a forward (Gemma-3's rotary, once per attention kind; a norm shared by two
    branches) keeps the rows of its last call that computes a compared position, since each call overwrites
    them; its trail is recorded from that same last call, so that the trail holds the value the locator
    compares (a trail of another call would not contain it). A hook that fails must not abort the engine's step
    (a vLLM step's requests would stay queued): the error is kept, capture stops, and it is raised on exit."""

    def __init__(self, modules: dict[str, torch.nn.Module], spec: CaptureSpec, layout: RowLayout):
        self.modules, self.spec, self.layout = modules, spec, layout
        self.capture = Capture()
        self.handles = []
        self.error: Exception | None = None
        self._recorder: OpRecorder | None = None

    def step(self, m: torch.Tensor) -> None:
        """The map of the forward call about to run; a call that holds compared tokens counts as a forward."""
        self.layout.set(m)
        if self.layout.targets():
            self.capture.forwards += 1

    def __enter__(self):
        spec = self.spec
        names = set(spec.outputs) | set(spec.inputs) | set(spec.replace)
        if spec.trail_module:
            names.add(spec.trail_module)
        hooked = [(n, self.modules[n]) for n in sorted(names) if n in self.modules]
        if self.layout.step_module is not None:  # first: the step's map is set before any capture hook of the step
            step = lambda module, args, kwargs: self.step(self.layout.step_map(args, kwargs))  # noqa: E731
            self.handles.append(self.modules[self.layout.step_module].register_forward_pre_hook(
                self._guarded(step), with_kwargs=True))
        for name, m in hooked:
            self.handles.append(m.register_forward_pre_hook(self._guarded(self._pre(name)), with_kwargs=True))
            self.handles.append(m.register_forward_hook(self._guarded(self._post(name)), with_kwargs=True))
        return self

    def __exit__(self, exc_type, exc, tb):
        for h in self.handles:
            h.remove()
        self._stop_trail()  # an exception inside the traced call
        if self.error is not None and exc_type is None:
            e = self.error
            raise RuntimeError(f"capture hook failed: {type(e).__name__}: {e}") from e

    def _guarded(self, fn):
        def hook(*a):
            if self.error is not None:
                return None
            try:
                return fn(*a)
            except Exception as e:  # noqa: BLE001  kept, raised once the engine's run is over
                self.error = e
                self._stop_trail()
                return None
        return hook

    def _pre(self, name):
        spec, capture = self.spec, self.capture

        def hook(module, args, kwargs):
            targets = self.layout.targets()
            if not targets:
                return None
            if name not in capture.order:
                capture.order.append(name)
            new = None
            if name in spec.replace:
                new = args, kwargs = self.layout.replace(module, args, kwargs, spec.replace[name])
            if name in spec.inputs:
                tensors, keys = self.layout.inputs(module, args, kwargs)
                _keep(capture.inputs.setdefault(name, {}), [self.layout.view(t) for t in tensors], targets, keys)
            if name == spec.trail_module:
                self._start_trail(module, args, kwargs)
            return new
        return hook

    def _post(self, name):
        def hook(module, args, kwargs, out):
            if name == self.spec.trail_module:
                self._stop_trail()
            targets = self.layout.targets()
            if name in self.spec.outputs and targets:
                views = [v for v in map(self.layout.view, self.layout.outputs(name, out)) if v is not None]
                _keep(self.capture.outputs.setdefault(name, {}), views, targets, None)
            return None
        return hook

    def _start_trail(self, module, args: tuple, kwargs: dict) -> None:
        """Record this call's operators when it computes the traced position (a later such call starts again)."""
        fi = next((i for i, pos in self.layout.targets() if pos == self.spec.trail_position), None)
        if fi is None or self._recorder is not None:
            return
        B, T = self.layout.shape
        self.capture.trail = Trail([], B, T, fi)
        prov = Provenance(B, T)
        for v in self.layout.trail_inputs(module, args, kwargs):  # the trail's tokens follow from them
            prov.seed(v)
        self._recorder = OpRecorder(self.capture.trail.calls, self.capture.trail.errors, provenance=prov)
        self._recorder.__enter__()

    def _stop_trail(self) -> None:
        if self._recorder is not None:
            self._recorder.__exit__(None, None, None)
            self._recorder = None
