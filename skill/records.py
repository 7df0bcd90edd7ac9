"""Result records: what a gate measured, its verdict, and what it ran on."""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any

from pydantic import BaseModel, Field, field_validator

from tic.gates.base import Verdict
from tic.harness.measure.fingerprint import environment_fingerprint  # noqa: F401 - every record carries it


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
    # content hash of each other input the gate read (prompts file, dumps, the cut), by name
    inputs: dict[str, str] = Field(default_factory=dict)
    environment: dict[str, Any] = Field(default_factory=dict)
    tic_version: str = ""
    started_at: str = Field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    duration_s: float = 0.0

    @field_validator("started_at")
    @classmethod
    def _timestamp(cls, v: str) -> str:
        t = datetime.fromisoformat(v)  # a ValueError makes the record unreadable, never a crash later
        if t.tzinfo is None:
            raise ValueError("started_at has no time zone")
        return v

    @property
    def passed(self) -> bool:
        return self.verdict == Verdict.PASS

    def age_s(self) -> float:
        t = datetime.fromisoformat(self.started_at)
        return time.time() - t.timestamp()
