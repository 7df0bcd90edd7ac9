"""The verdict table of a device run: one row per config, one cell per gate, from the run's gate records.

  python benchmarks/gpu/verdicts.py RESULTS_DIR --gates C5,C6,C7 [--cell verdict|figure|reason] NAME ...

A config's records are RESULTS_DIR/<name>-ladder.json (drive.py, run_gates.py) or, one file per gate,
RESULTS_DIR/<name>-<gate>.json (`tic gate CN --json`, tp_c5.py; gate in lower case). Cells: the verdict; with
`figure`, the verdict and the key figure; with `reason`, also the gate's reason. A gate without a record is
"not run (see log)". Only the standard library.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def records(results: Path, name: str, gates: list[str]) -> dict[str, dict]:
    ladder = _load(results / f"{name}-ladder.json")
    if ladder is not None:
        return {r["gate"]: r for r in ladder["results"]}
    out = {}
    for g in gates:
        rec = _load(results / f"{name}-{g.lower()}.json")
        if rec is not None:
            out[g] = rec["results"][0] if "results" in rec else rec
    return out


def cell(rec: dict | None, style: str) -> str:
    if rec is None:
        return "not run (see log)"
    figure = rec.get("key_figure") or rec.get("key", "")
    if style == "verdict":
        return rec["verdict"]
    if style == "figure":
        return f"{rec['verdict']} {figure}"
    return f"{rec['verdict']}: {figure} -- {rec.get('reason', '')[:300]}"


def table(results: Path, names: list[str], gates: list[str], style: str) -> str:
    lines = ["| config | " + " | ".join(gates) + " |", "|---|" + "---|" * len(gates)]
    for name in names:
        recs = records(results, name, gates)
        lines.append(f"| {name} | " + " | ".join(cell(recs.get(g), style) for g in gates) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("names", nargs="+")
    ap.add_argument("--gates", required=True, help="comma-separated, e.g. C5,C6,C7")
    ap.add_argument("--cell", choices=("verdict", "figure", "reason"), default="figure")
    a = ap.parse_args()
    print(table(a.results, a.names, a.gates.split(","), a.cell))


if __name__ == "__main__":
    main()
