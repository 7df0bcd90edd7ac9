"""Benchmark: the locator on random single-point plants in random tiny models of several families and kernels.

Each trial draws a model (tic.harness.testing.tinymodels: qwen3, qwen3_moe, llama, mistral, mixtral, gemma3_text; seeded
random sizes and weights), its kernels (tic's consistent CPU kernel wrappers, side A decoding and side B scoring
in layouts of their own; or stock transformers modules, both sides in one layout), a compared sequence and both
sides' batch layouts, and one plant at a random module (tic.harness.testing.plants): on one side, or, for a kernel whose
arithmetic follows the launch's row count, on both. The locator must name the plant's layer, module and
operator, and its repro must exit 1; with the plant removed, the same repro script, its planted side's entry
recorded anew (tic.harness.locate.search.recheck_repro; both sides' modules for a plant on both), must exit 0.
Controls: nothing planted, or the same plant on both sides; both must report no divergence and emit no repro.
Plants whose change does not reach a compared stage (rounded away downstream, or a branch never taken) are
redrawn, and counted per kind: every kind's draws, and how many reached a compared stage, are in the table.

Run: .venv/bin/python benchmarks/bench_locate_plants.py [--plants 300] [--controls 40] [--jsonl out.jsonl]
     [--start SEED]; --table-from A.jsonl B.jsonl prints one table over runs made side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402

from tic.harness.testing.plants import run_trial  # noqa: E402

TARGET_S = 30.0


def _pct(n: int, d: int) -> str:
    return f"{100.0 * n / d:.1f} % ({n}/{d})" if d else "-"


KINDS = ("same operator, the traced token's arguments bit-identical, different bits",
         "same operator, arguments that differ", "different operator sequences")


def _kind(r: dict) -> str:
    return r["kind"].split(" (")[0] + (" (both sides)" if r.get("both") else "")


def _groups(lines: list[str], plants: list[dict], key: str) -> None:
    values = sorted({r[key] for r in plants})
    lines += ["| | " + " | ".join(values) + " | all |", "|---|" + "---|" * (len(values) + 1)]

    def row(label, fn):
        cells = [fn([r for r in plants if r[key] == v]) for v in values] + [fn(plants)]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    ok = lambda r: r["status"] != "crash"  # noqa: E731
    emitted = lambda rs: [r for r in rs if r.get("repro_exit") == 1]  # noqa: E731
    row("plants", lambda rs: str(len(rs)))
    row("layer right", lambda rs: _pct(sum(bool(r.get("layer_right")) for r in rs), len(rs)))
    row("module right", lambda rs: _pct(sum(bool(r.get("module_right")) for r in rs), len(rs)))
    row("operator right", lambda rs: _pct(sum(bool(r.get("operator_right")) for r in rs), len(rs)))
    row("operator unresolved", lambda rs: str(sum(ok(r) and r.get("module_right") and not r.get("operator")
                                                  for r in rs)))
    row("operator wrong (named, not the plant's)", lambda rs: str(sum(
        bool(r.get("operator")) and not r.get("operator_right") for r in rs)))
    row("repro exits 1", lambda rs: _pct(sum(r.get("repro_exit") == 1 for r in rs), len(rs)))
    row("repro exits 0 without the plant", lambda rs: _pct(
        sum(r.get("repro_exit_without_plant") == 0 for r in emitted(rs)), len(emitted(rs))))
    row("repro exits 1 without the plant", lambda rs: str(sum(r.get("repro_exit_without_plant") == 1 for r in rs)))
    row("without the plant: operator / module rerun", lambda rs: " / ".join(str(sum(
        r.get("repro_without_plant_kind") == k for r in emitted(rs))) for k in ("operator", "module")))
    for kind in KINDS:
        row(f"repro: {kind}", lambda rs, k=kind: str(sum((r.get("repro_proves") or "").startswith(k) for r in rs)))
    row("crashes", lambda rs: str(sum(r["status"] == "crash" for r in rs)))
    row("locate s/plant mean", lambda rs: f"{statistics.mean([r['seconds'] for r in rs if ok(r)]):.1f}"
        if any(ok(r) for r in rs) else "-")
    row("locate s/plant max", lambda rs: f"{max([r['seconds'] for r in rs if ok(r)]):.1f}" if any(ok(r) for r in rs)
        else "-")


def table(rows: list[dict]) -> str:
    drawn = [r for r in rows if r["mode"] == "plant"]
    plants = [r for r in drawn if r["status"] not in ("ineffective", "absorbed")]
    controls = [r for r in rows if r["mode"] != "plant"]
    redrawn = [r for r in drawn if r["status"] in ("ineffective", "absorbed")]
    ok = lambda r: r["status"] != "crash"  # noqa: E731
    lines: list[str] = []
    _groups(lines, plants, "family")
    lines.append("")
    _groups(lines, [dict(r, kernels=r.get("kernels", "consistent")) for r in plants], "kernels")
    false_repros = sum(bool(r.get("repro_exit") == 1) for r in controls)
    clean = sum(bool(r.get("clean")) for r in controls)
    out = ["\n".join(lines), "",
           f"controls clean: {clean}/{len(controls)} ({sum(r['mode'] == 'clean' for r in controls)} nothing "
           f"planted, {sum(r['mode'] == 'symmetric' for r in controls)} same plant on both sides)",
           f"repros exiting 1 without a one-sided plant (controls): {false_repros}",
           f"crashes in controls: {sum(r['status'] == 'crash' for r in controls)}",
           f"redrawn plants: {sum(r['status'] == 'ineffective' for r in redrawn)} changed nothing, "
           f"{sum(r['status'] == 'absorbed' for r in redrawn)} rounded away before any compared stage",
           f"locate time target: <= {TARGET_S:.0f} s per plant; plants over it: "
           f"{sum(ok(r) and r['seconds'] > TARGET_S for r in plants)}"]
    kinds: dict[tuple, list] = defaultdict(lambda: [0, 0, 0, 0, 0, 0, 0])
    for r in drawn:
        c = kinds[(r.get("op_class") or "", _kind(r), r.get("kernels", "consistent"))]
        c[0] += 1
        c[1] += r["status"] == "ineffective"
        c[2] += r["status"] == "absorbed"
        if r in plants:
            c[3] += 1
            c[4] += bool(r.get("layer_right") and r.get("module_right") and r.get("operator_right"))
            c[5] += r.get("repro_exit") == 1
            c[6] += r.get("repro_exit") == 1 and r.get("repro_exit_without_plant") == 0
    out += ["", "Every plant kind drawn, by the operator class it changes and the kernels it ran on: how many changed "
            "nothing, were rounded away, or reached a compared stage (and were then located).", "",
            "| operator class | plant kind | kernels | drawn | changed nothing | rounded away | reached a compared stage "
            "| all three right | repro exits 1 | and 0 without the plant |", "|---|---|---|---|---|---|---|---|---|---|"]
    out += [f"| {oc} | {k} | {kern} | " + " | ".join(str(x) for x in c) + " |"
            for (oc, k, kern), c in sorted(kinds.items())]
    misses = [r for r in plants if not (r.get("layer_right") and r.get("module_right") and r.get("operator_right"))]
    if misses:
        out += ["", "misses:"]
        out += [f"- seed {r['seed']} {r['family']} ({r.get('kernels')}): {r['plant']}: status {r['status'][:90]!r}, "
                f"layer {r.get('layer')}, module {r.get('module')}, operator {r.get('operator')!r}, expected one of "
                f"{list(r.get('expected_operators') or [])}" + (f", error {r.get('error')}" if r.get("error") else "")
                for r in misses]
    stay = [r for r in plants if r.get("repro_exit") == 1 and r.get("repro_exit_without_plant") != 0]
    if stay:
        out += ["", "repros that do not exit 0 without the plant:"]
        out += [f"- seed {r['seed']} {r['family']}: {r['plant']}: exit {r.get('repro_exit_without_plant')} "
                f"({r.get('repro_without_plant_kind')}): {(r.get('repro_without_plant_output') or '')[-160:]!r}"
                for r in stay]
    no_repro = [r for r in plants if r.get("repro_exit") != 1]
    if no_repro:
        out += ["", "plants without a repro that exits 1:"]
        out += [f"- seed {r['seed']} {r['family']} ({r.get('kernels')}): {r['plant']}: status {r['status'][:120]!r}"
                for r in no_repro]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plants", type=int, default=300)
    ap.add_argument("--controls", type=int, default=40)
    ap.add_argument("--start", type=int, default=0, help="first seed")
    ap.add_argument("--jsonl", type=Path, default=None, help="also write one JSON line per trial here")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--table-from", type=Path, nargs="+", default=None,
                    help="print the table of trials already written by --jsonl runs (e.g. two seed ranges run at once)")
    a = ap.parse_args()
    if a.table_from:
        rows = [json.loads(line) for p in a.table_from for line in p.read_text().splitlines() if line.strip()]
        print(table(rows))
        return 0
    torch.set_num_threads(a.threads)
    work = Path(tempfile.mkdtemp(prefix="tic-bench-plants-"))
    os.environ.setdefault("TIC_CACHE", str(work / "cache"))
    os.chdir(work)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, cwd {work}", flush=True)
    rows: list[dict] = []
    sink = a.jsonl.open("a") if a.jsonl else None
    seed, t0 = a.start, time.perf_counter()
    n_plants = n_controls = 0
    every = max(1, a.plants // max(1, a.controls)) if a.controls else 0
    while n_plants < a.plants or n_controls < a.controls:
        modes = []
        if n_plants < a.plants:
            modes.append("plant")
        if a.controls and n_controls < a.controls and (seed % every == 0 or n_plants >= a.plants):
            modes.append("clean" if (seed // every) % 2 == 0 else "symmetric")
        for mode in modes:
            r = run_trial(seed, work / f"{mode}-{seed}", mode=mode)
            rows.append(r)
            if sink:
                sink.write(json.dumps(r, default=str) + "\n")
                sink.flush()
            if mode == "plant" and r["status"] not in ("ineffective", "absorbed"):
                n_plants += 1
            elif mode != "plant":
                n_controls += 1
            print(f"[{time.perf_counter() - t0:7.0f} s] seed {seed} {mode} {r['family']} {r.get('kernels')}: "
                  f"{r.get('plant')} -> "
                  f"{r['status'][:60]} L{int(bool(r.get('layer_right')))}M{int(bool(r.get('module_right')))}"
                  f"O{int(bool(r.get('operator_right')))} repro {r.get('repro_exit')}, "
                  f"without the plant {r.get('repro_exit_without_plant')}", file=sys.stderr, flush=True)
        seed += 1
    print(table(rows))
    print(f"\ntotal wall time {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
