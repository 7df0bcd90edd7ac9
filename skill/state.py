"""Ladder state in .tic/: one JSON record per gate (results/<gate id>.json), written atomically."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tic.core.fsio import atomic_write_text
from tic.gates import REGISTRY
from tic.skill.records import GateResult

UNREADABLE = "unreadable"


class LadderState:
    def __init__(self, root: Path):
        self.root = Path(root)

    @property
    def results_dir(self) -> Path:
        return self.root / "results"

    def artifacts_dir(self, gate: str) -> Path:
        """Where a gate writes evidence; created only when a gate writes there."""
        return self.root / "artifacts" / gate

    def record_path(self, gate: str) -> Path:
        return self.results_dir / f"{gate}.json"

    def locate_dir(self, gate: str) -> Path:
        """The locator's report, chart and repro for a gate's last failure (harness/locate/search.py writes there)."""
        return self.artifacts_dir(gate) / "locate"

    def clear_locate(self, gate: str) -> bool:
        """Remove a gate's locate artifacts once it shows no divergence: a report and repro of a failure that
        no longer exists would read as current. Returns whether anything was removed."""
        d = self.locate_dir(gate)
        if not d.is_dir():
            return False
        shutil.rmtree(d)
        return True

    def save(self, result: GateResult) -> Path:
        path = self.record_path(result.gate)
        atomic_write_text(path, result.model_dump_json(indent=2))
        return path

    def read(self, gate: str) -> GateResult | str | None:
        """The record of one gate; None when absent, UNREADABLE when present but not a valid record of it."""
        path = self.record_path(gate)
        if not path.exists():
            return None
        try:
            r = GateResult.model_validate(json.loads(path.read_bytes().decode("utf-8")))
        except (ValueError, OSError, RecursionError):
            return UNREADABLE
        return r if r.gate == gate else UNREADABLE

    def load(self, gate: str) -> GateResult | None:
        r = self.read(gate)
        return r if isinstance(r, GateResult) else None  # an unreadable record is never a pass

    def all(self, gate_ids: list[str] | None = None) -> dict[str, GateResult | str]:
        """Records of the named gates (default: every registered gate); only files tic names itself are read,
        so a backup such as C5.old.json is never taken for C5."""
        if gate_ids is None:
            gate_ids = [g.id for g in REGISTRY]
        return {g: r for g in gate_ids if (r := self.read(g)) is not None}
