"""Result records: what a gate measured, its verdict, and what it ran on."""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, Field

from tic.harness.fingerprint import environment_fingerprint  # noqa: F401 - every record carries it

Verdict = Literal["pass", "fail", "unavailable", "error", "skipped"]


class GateResult(BaseModel):
    gate: str
    title: str
    verdict: Verdict
    reason: str = ""
    key_figure: str = ""
    metrics: dict[str, Any] = Field(default_factory=dict)
    details: dict[str, Any] = Field(default_factory=dict)
    evidence: list[str] = Field(default_factory=list)
    config_hash: str = ""
    model_hash: str = ""
    environment: dict[str, Any] = Field(default_factory=dict)
    tic_version: str = ""
    started_at: str = Field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    duration_s: float = 0.0

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    def age_s(self) -> float:
        t = datetime.fromisoformat(self.started_at)
        return time.time() - t.timestamp()
