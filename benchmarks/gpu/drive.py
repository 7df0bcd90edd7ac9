"""Run one ladder config on the GPU and keep everything needed to check it offline.

  python benchmarks/gpu/drive.py CONFIG.yaml OUTDIR [--from C0 --to C5] [--baseline-by NAME]

Writes OUTDIR/<name>-ladder.json (the ladder's JSON record, as `tic ladder --json` prints it),
OUTDIR/<name>-train.jsonl (every HF train-side score: ids and logprobs), the vLLM engine's own raw records
(rollout.options.record) and OUTDIR/<name>-locate.json: the shared locator's findings for each failing
C3/C4/C5 (tic.harness.locate.search.locate_for_gate, run by the ladder runner; reports and repros in the state dir).
--baseline-by NAME first measures the C1 baseline (tic baseline run), freezes it and approves it as NAME.
The body runs under a main guard: vLLM engine cores of their own (C1/C10 sides) start by spawn, which
re-imports this file.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


import tic
from tic.harness.engines.hf import HFEngine
from tic.config.schema import load_config
from tic.skill.context import GateContext
from tic.skill.runner import run_ladder
from tic.core.fsio import atomic_write_text


def main() -> None:
    cfg_path, out = Path(sys.argv[1]), Path(sys.argv[2])
    start = sys.argv[sys.argv.index("--from") + 1] if "--from" in sys.argv else "C0"
    stop = sys.argv[sys.argv.index("--to") + 1] if "--to" in sys.argv else "C5"
    name = cfg_path.stem
    out.mkdir(parents=True, exist_ok=True)
    train_log = out / f"{name}-train.jsonl"
    _lines: list[str] = []
    _score = HFEngine.score

    def recording_score(self, samples, sampling):
        res = _score(self, samples, sampling)
        for s, t in zip(samples, res):
            _lines.append(json.dumps({"prompt_token_ids": s.prompt_ids, "token_ids": s.response_ids,
                                      "logprobs": t.double().tolist()}) + "\n")
        atomic_write_text(train_log, "".join(_lines))
        return res

    HFEngine.score = recording_score

    cfg = load_config(cfg_path)
    if "--baseline-by" in sys.argv:
        from tic.harness.measure import baseline as bl
        from tic.skill.baseline_cmd import measure_baseline

        bctx = GateContext(cfg)
        record, requests = measure_baseline(bctx)
        bl.write_baseline(bl.baseline_dir(cfg), record, requests)
        bl.freeze(bl.baseline_dir(cfg))
        bl.approve(bl.baseline_dir(cfg), sys.argv[sys.argv.index("--baseline-by") + 1])
        print(f"[{name}] baseline frozen: {record['throughput_tok_s']}", flush=True)
    if os.environ.get("TIC_LOCATE", "1") == "0":  # the shared locator off
        cfg.locate.enabled = False
    ctx = GateContext(cfg)
    t0 = time.time()
    done: list = []


    def on_result(r):  # the ladder JSON is rewritten after every gate: a run cut short keeps what it measured
        done.append(r)
        print(f"[{name}] {r.gate:<4} {r.verdict:<11} {r.key_figure}", flush=True)
        atomic_write_text(out / f"{name}-ladder.json", json.dumps(
            {"tic_version": tic.__version__, "config": name, "results": [x.model_dump(mode="json") for x in done]},
            indent=1, default=str))


    results = run_ladder(ctx, start, stop, keep_going=True, on_result=on_result)
    print(f"[{name}] ladder done in {time.time() - t0:.0f}s", flush=True)

    # the locator's findings per failing gate (the full reports, charts and repro scripts are under the state dir)
    found = {r.gate: (r.details or {}).get("locate") for r in results if r.gate in ("C3", "C4", "C5") and r.verdict == "fail"}
    for g, f in found.items():
        f = f or {}
        print(f"[{name}] locate {g}: {f.get('status')} | layer {f.get('first_divergent_layer')} | module "
              f"{f.get('culprit_module')} | op {f.get('first_operator')} | repro {(f.get('repro_check') or {}).get('reproduces')}",
              flush=True)
    atomic_write_text(out / f"{name}-locate.json", json.dumps(found, indent=1, default=str))


if __name__ == "__main__":
    main()
