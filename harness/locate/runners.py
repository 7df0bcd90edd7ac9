"""Which capture runner (tic.harness.locate.capture.CaptureRunner) the locator drives for each engine.

Engines know nothing of the locator: a runner is picked here by the engine's class (the nearest registered class
in its method resolution order), and drives the engine through what it exposes anyway (its model, its runs). An
engine of another package (a test's stand-in) registers its own runner with `register`.

Ranked engines (tic.harness.engines.ranks.DealtRequests) get `OwnerRankCaptureRunner`: the rank that owns the
compared request runs its own engine's runner on its own share of the requests, as it ran them, through the
engine's `on_owner`, while the other ranks keep the layout's lockstep.
"""

from __future__ import annotations

from typing import Callable

from tic.core.errors import TicInputError
from tic.harness.engines.hf import HFEngine
from tic.harness.engines.megatron import MegatronEngine
from tic.harness.engines.ranks import DealtRequests
from tic.harness.engines.vllm import VLLMEngine
from tic.harness.locate.capture import CaptureRunner
from tic.harness.locate.hf_capture import HFCaptureRunner
from tic.harness.locate.megatron_capture import MegatronCaptureRunner
from tic.harness.locate.portable import portable, runner_names
from tic.harness.locate.vllm_capture import VLLMCaptureRunner

_RUNNERS: dict[type, Callable] = {}


def register(engine_type: type, runner: Callable) -> None:
    """Engines of `engine_type` (and its subclasses) run with capture through runner(engine, temperature)."""
    _RUNNERS[engine_type] = runner


def runner_for(engine, temperature: float) -> CaptureRunner:
    for cls in type(engine).__mro__:
        if cls in _RUNNERS:
            return _RUNNERS[cls](engine, temperature)
    raise TicInputError(f"engine {getattr(engine, 'name', engine)!r} cannot run with capture (no capture runner "
                        f"for {type(engine).__name__})")


# -- ranked engines ------------------------------------------------------------------------------------------
def _names_on_rank(engine, temperature: float) -> dict:
    return runner_names(runner_for(engine, temperature))


def _capture_on_rank(engine, share: list, index: int, kind: str, upto: int, spec, together: bool,
                     temperature: float):
    runner = runner_for(engine, temperature)
    cap = runner.decode(share, index, upto, spec, together) if kind == "decode" else runner.score(share, index, spec)
    return portable(cap)


class OwnerRankCaptureRunner:
    """The locator's runner for a ranked engine: the owner of the compared request captures on its own share
    (as it ran it), while the other ranks do what the layout needs of them meanwhile (the engine's `on_owner`).
    Module names are read once, from every rank's runner."""

    def __init__(self, engine: DealtRequests, temperature: float):
        self.engine, self.temperature = engine, temperature
        self._names = engine.on_every_rank(_names_on_rank, temperature)[0]
        self.repro_setup = self._names["repro_setup"]

    def stages(self) -> list[str]:
        return self._names["stages"]

    def children(self, name: str) -> list[str]:
        return self._names["children"][name]

    def descendants(self, name: str) -> list[str]:
        return [n for n in self._names["names"] if n.startswith(name + ".")]

    def decode(self, samples, target, upto, spec, together=False):
        # a teacher-forced decode through `upto` runs upto + 1 forward passes
        return self.engine.on_owner(samples, target, _capture_on_rank,
                                    ("decode", upto, spec, together, self.temperature), forwards=upto + 1)

    def score(self, samples, target, spec):
        return self.engine.on_owner(samples, target, _capture_on_rank, ("score", 0, spec, False, self.temperature),
                                    forwards=1)


register(HFEngine, HFCaptureRunner)
register(VLLMEngine, VLLMCaptureRunner)
register(MegatronEngine, MegatronCaptureRunner)
register(DealtRequests, OwnerRankCaptureRunner)
