"""A gate is data (what it measures, its pass condition, its guide) plus two functions: measure and judge.

measure(ctx) -> dict of measured values (raises TicInputError on bad input).
judge(measured) -> Judgement. The judge *is* the pass condition as code; `tic explain` prints its source.
A gate that a later release implements has measure = None and is reported `unavailable`, never pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Judgement:
    verdict: str  # pass | fail
    reason: str
    key_figure: str = ""


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
    measure: Callable[[Any], dict] | None = None
    judge: Callable[[dict], Judgement] | None = None
    needs_model: bool = True
    locate_on_fail: bool = False
    implemented_by: str = ""  # for unavailable gates: which release/issue brings them
    # Inputs the gate reads, checked before a run writes anything: any of "model", "rollout", "train",
    # "prompts", "layouts", "cut" (tic.skill.preflight); None = all of them.
    reads: tuple[str, ...] | None = None
    # Gate-specific input checks (e.g. a comparison that would compare a thing with itself), run before any write.
    validate: Callable[[Any], None] | None = None

    @property
    def available(self) -> bool:
        return self.measure is not None and self.judge is not None


UNAVAILABLE = "unavailable: implemented by a later release"


@dataclass
class GateRun:
    """What the runner hands back for one gate (before it becomes a GateResult record)."""

    verdict: str
    reason: str
    key_figure: str = ""
    metrics: dict = field(default_factory=dict)
    details: dict = field(default_factory=dict)
    evidence: list[str] = field(default_factory=list)
