"""A gate is data (what it measures, its pass condition, its guide) plus two functions: measure and judge.

measure(ctx) -> Measurement (raises TicInputError on bad input). A gate that cannot measure here (this engine
cannot do what it needs; a later release implements the gate) says so in one way, Measurement.unavailable: the
runner records that as Verdict.UNAVAILABLE, never a pass, and does not judge.
judge(measurement) -> Judgement: pass or fail, and why. The judge *is* the pass condition as code; `tic explain`
prints its source.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable


class Verdict(str, Enum):
    """A gate's outcome; records store it as its value ("pass", "fail", ...)."""

    PASS = "pass"
    FAIL = "fail"
    UNAVAILABLE = "unavailable"  # not measured here (Measurement.unavailable says why): never a pass
    ERROR = "error"  # measure or judge raised
    SKIPPED = "skipped"  # not run: an earlier gate of the climb did not pass
    WAITING = "waiting"  # nothing wrong, a step is still to be taken (C1: the baseline, a person's approval)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Measurement:
    """What measure returns: the figures the judge reads (metrics), what explains them (details), the files it
    wrote (evidence); or, with nothing else, why this gate measures nothing here (unavailable)."""

    metrics: dict[str, Any] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    evidence: list[str] = field(default_factory=list)
    unavailable: str = ""


@dataclass(frozen=True)
class Judgement:
    """What judge returns: pass, fail or waiting (a step outside tic is still to be taken: C1's baseline, a person's
    approval; the other verdicts come from the runner), the reason and the figure a table shows for it."""

    verdict: Verdict
    reason: str
    key_figure: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "verdict", Verdict(self.verdict))
        if self.verdict not in (Verdict.PASS, Verdict.FAIL, Verdict.WAITING):
            raise ValueError(f"a judge says pass, fail or waiting, not {self.verdict.value}; a gate that cannot "
                             "measure returns Measurement(unavailable=why)")


@dataclass
class Gate:
    id: str
    title: str
    step: int
    measures: str
    pass_condition: str
    inputs: list[str]
    artifacts: list[str]
    guide: str
    measure: Callable[[Any], Measurement] | None = None  # None with implemented_by: a later release measures it
    judge: Callable[[Measurement], Judgement] | None = None
    needs_model: bool = True
    locate_on_fail: bool = False
    implemented_by: str = ""  # for a gate this release does not measure: which release/issue brings it
    # Inputs the gate reads, checked before a run writes anything: any of "model", "rollout", "train",
    # "prompts", "layouts", "cut" (tic.skill.preflight); None = all of them.
    reads: tuple[str, ...] | None = None
    # Gate-specific input checks (e.g. a comparison that would compare a thing with itself), run before any write.
    validate: Callable[[Any], None] | None = None

    def __post_init__(self) -> None:
        if (self.measure is None or self.judge is None) != bool(self.implemented_by):
            raise ValueError(f"{self.id}: give measure and judge, or implemented_by for a later release's gate")
        if self.measure is None:
            self.measure = self._later_release

    def _later_release(self, ctx) -> Measurement:
        return Measurement(details={"implemented_by": self.implemented_by},
                           unavailable=f"implemented by a later release ({self.implemented_by})")
