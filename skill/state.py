"""Ladder state in .tic/: one JSON record per gate, written atomically."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tic.core.fsio import atomic_write_text
from tic.skill.records import GateResult


class LadderState:
    def __init__(self, root: Path):
        self.root = Path(root)

    @property
    def results_dir(self) -> Path:
        return self.root / "results"

    def artifacts_dir(self, gate: str) -> Path:
        """Where a gate writes evidence; created only when a gate writes there."""
        return self.root / "artifacts" / gate

    def locate_dir(self, gate: str) -> Path:
        """The locator's report, chart and repro for a gate's last failure (harness/locate.py writes there)."""
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
        path = self.results_dir / f"{result.gate}.json"
        atomic_write_text(path, result.model_dump_json(indent=2))
        return path

    def load(self, gate: str) -> GateResult | None:
        path = self.results_dir / f"{gate}.json"
        if not path.is_file():
            return None
        try:
            return GateResult.model_validate(json.loads(path.read_text()))
        except (ValueError, OSError):
            return None  # an unreadable record is treated as absent, never as a pass

    def all(self) -> dict[str, GateResult]:
        out = {}
        if self.results_dir.is_dir():
            for p in sorted(self.results_dir.glob("C*.json")):
                r = self.load(p.stem)
                if r is not None:
                    out[r.gate] = r
        return out
