"""Benchmark `tic compare`: peak RSS on two large dumps vs two small ones, each in a fresh process.

The dumps hold identical records (the whole comparison runs, nothing stops early); the large pair is
--big-mib per file, the small pair --small-mib. Each `tic compare` runs as a child process and its own peak RSS
(ru_maxrss from wait4) is read; every size runs --rounds times and the median is reported. Target (issue 12):
the difference between the large and the small pair <= 64 MiB, i.e. memory does not grow with the dump.

    .venv/bin/python benchmarks/bench_compare_rss.py [--big-mib 200] [--small-mib 1] [--rounds 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESPONSE_LEN = 512


def write_dump(path: Path, mib: float, seed: int = 0) -> int:
    """Records of RESPONSE_LEN float32-exact logprobs until the file reaches `mib`; returns the record count."""
    rng = random.Random(seed)
    target = int(mib * (1 << 20))
    n = 0
    with path.open("w") as f:
        while f.tell() < target:
            lp = [float(f"{-rng.random() * 8:.7g}") for _ in range(RESPONSE_LEN)]
            rec = {"id": n, "prompt_ids": [rng.randrange(4, 1000) for _ in range(32)],
                   "response_ids": [rng.randrange(4, 1000) for _ in range(RESPONSE_LEN)], "logprobs": lp}
            f.write(json.dumps(rec) + "\n")
            n += 1
    return n


def peak_rss_mib(args: list[str]) -> tuple[float, float, int]:
    """(peak RSS MiB, seconds, exit code) of one fresh `tic compare` process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "tic.skill.cli", "compare", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_maxrss / 1024, time.perf_counter() - t0, proc.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--big-mib", type=float, default=200)
    ap.add_argument("--small-mib", type=float, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the dumps are written (default: a temporary directory)")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tic-bench-compare-", dir=a.dir))
    try:
        sizes = {"small": a.small_mib, "big": a.big_mib}
        pairs, counts, rows = {}, {}, {}
        for name, mib in sizes.items():
            r, t = root / f"{name}-rollout.jsonl", root / f"{name}-train.jsonl"
            counts[name] = write_dump(r, mib)
            shutil.copyfile(r, t)
            pairs[name] = [str(r), str(t)]
        for name in sizes:
            runs = [peak_rss_mib(pairs[name]) for _ in range(a.rounds)]
            if any(code != 0 for _, _, code in runs):
                raise SystemExit(f"tic compare on the {name} pair exited {[c for _, _, c in runs]}, expected 0")
            rows[name] = (statistics.median(r for r, _, _ in runs), statistics.median(s for _, s, _ in runs),
                          [round(r, 1) for r, _, _ in runs])
        diff = rows["big"][0] - rows["small"][0]
        print(f"tic compare peak RSS, median of {a.rounds} fresh processes each (Python {sys.version.split()[0]})")
        print()
        print("| dumps | size per file | records | peak RSS (MiB) | rounds (MiB) | time (s) |")
        print("|-------|---------------|---------|----------------|--------------|----------|")
        for name in sizes:
            size = Path(pairs[name][0]).stat().st_size / (1 << 20)
            rss, sec, per = rows[name]
            print(f"| 2 x {name:<5} | {size:.1f} MiB | {counts[name]} | {rss:.1f} | {per} | {sec:.1f} |")
        print()
        print(f"difference big - small: {diff:.1f} MiB (target <= 64 MiB: {'met' if diff <= 64 else 'NOT met'})")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
