"""Run a list of gates of one tic.yaml and write their records as JSON after each gate (a run cut short keeps what
it measured); a C0 that refuses the configuration ends the run.

  python benchmarks/gpu/run_gates.py CONFIG.yaml OUT.json --gates C0,C3,C4,C5,C6,C7 [--no-locate]

Every input of the listed gates is checked first, as `tic ladder` does. The locator runs on each failing
consistency gate unless --no-locate (its reports and repros go to the config's state_dir). The body runs under a
main guard: vLLM engine cores of their own start by spawn, which re-imports this file.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--gates", default="C0,C3,C4,C5,C6,C7")
    ap.add_argument("--no-locate", action="store_true")
    a = ap.parse_args()

    import tic
    from tic.core.fsio import atomic_write_text
    from tic.gates import get
    from tic.config.schema import load_config
    from tic.skill.context import GateContext
    from tic.skill.preflight import validate_run
    from tic.skill.runner import run_gate

    cfg = load_config(a.config)
    if a.no_locate:
        cfg.locate.enabled = False
    ctx = GateContext(cfg)
    gates = [get(g) for g in a.gates.split(",")]
    validate_run(ctx, gates)
    done = []
    for gate in gates:
        t0 = time.time()
        res = run_gate(gate, ctx)
        done.append(res.model_dump(mode="json"))
        print(f"[{a.config.stem}] {gate.id:<4} {res.verdict:<11} {res.key_figure} ({time.time() - t0:.0f} s)",
              flush=True)
        atomic_write_text(a.out, json.dumps({"tic_version": tic.__version__, "config": a.config.stem,
                                             "results": done}, indent=1, default=str))
        if gate.id == "C0" and res.verdict != "pass":
            break  # refused: what C0 names is outside what the later gates can make consistent


if __name__ == "__main__":
    main()
