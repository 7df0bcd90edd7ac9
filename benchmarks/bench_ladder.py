"""How long the embedded ladder takes on this machine (stock and consistent kernels, side by side).

    .venv/bin/python benchmarks/bench_ladder.py

Prints a table: config, wall seconds per gate (failing gates include the locator) and in total, and the consistent/stock ratio. Each config runs
in a fresh process with an empty state directory, weights generated beforehand (generation is not timed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIGS = ["examples/tiny-qwen3/tic.yaml", "examples/tiny-qwen3/tic-consistent.yaml",
           "examples/tiny-qwen3-moe/tic.yaml", "examples/tiny-qwen3-moe/tic-consistent.yaml"]


def run(cfg: str) -> tuple[float, dict]:
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "tic.skill.cli", "ladder", "-c", str(REPO / cfg), "--keep-going",
                            "--json"], cwd=d, capture_output=True, text=True, env={**os.environ, "NO_COLOR": "1"})
        wall = time.perf_counter() - t0
    rec = json.loads(p.stdout)
    return wall, {r["gate"]: r for r in rec["results"]}


def main() -> None:
    for cfg in CONFIGS:  # build weights first, so generation is not timed
        subprocess.run([sys.executable, "-m", "tic.skill.cli", "gate", "C0", "-c", str(REPO / cfg)],
                       cwd=tempfile.mkdtemp(), capture_output=True)
    rows = []
    for cfg in CONFIGS:
        wall, rec = run(cfg)
        rows.append((cfg, wall, rec))
    gates = ["C0", "C2", "C3", "C4", "C5"]
    print(f"{'config':<44} " + " ".join(f"{g:>10}" for g in gates) + f" {'total s':>9}")
    for cfg, wall, rec in rows:
        cells = " ".join(f"{rec[g]['duration_s']:>7.2f} {rec[g]['verdict'][:2]}" for g in gates)
        print(f"{cfg:<44} {cells} {wall:>9.2f}")
    print(f"\nconsistent/stock wall ratio: dense {rows[1][1] / rows[0][1]:.2f}x, moe {rows[3][1] / rows[2][1]:.2f}x "
          f"(threads: {os.cpu_count()} cores; target: each ladder <= 180 s on 2 cores)")


if __name__ == "__main__":
    main()
