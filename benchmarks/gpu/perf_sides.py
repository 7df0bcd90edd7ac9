"""Throughput of vLLM default, tic's bundled patches and vLLM's batch-invariant mode, side by side in one run.

  python benchmarks/gpu/perf_sides.py CONFIG.yaml [--repeats 3]

C10's own measurement (tic.harness.measure.perf.measure_sides: alternating passes on the config's perf workload), with
three sides, each an engine core in a process of its own (its patches and batch-invariant mode set at start):
default (vLLM as users run it: C1's baseline), tic (the config's rollout), batch-invariant (VLLM_BATCH_INVARIANT=1,
vLLM's default mode otherwise). Prints the
medians and each side's ratio to default; --json writes the raw passes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    from tic.harness.engines import build_engine
    from tic.harness.engines.vllm import VLLMEngine
    from tic.harness.measure.perf import Workload, measure_sides, spread
    from tic.config.schema import EngineConfig, load_config
    from tic.skill.context import GateContext

    cfg = load_config(Path(sys.argv[1]))
    repeats = int(sys.argv[sys.argv.index("--repeats") + 1]) if "--repeats" in sys.argv else cfg.perf.repeats
    ctx = GateContext(cfg)
    r = cfg.rollout
    # default and batch-invariant mode as users run vLLM (its own compilation and graph defaults: C1's baseline);
    # tic's side as configured
    users = VLLMEngine.baseline_changes(r)
    users = {**users, "options": {**users["options"], "engine_process": "own", "record": None}}
    sides_cfg = {
        "default": users,
        "tic patches": {"options": {**r.options, "engine_process": "own", "record": None,
                                    "batch_invariant": False}, "patches": list(r.patches)},
        "batch-invariant": {**users, "options": {**users["options"], "batch_invariant": True}},
    }
    sides = {}
    for name, ch in sides_cfg.items():
        side = EngineConfig.model_validate({**r.model_dump(), **ch})
        sides[name] = (build_engine("rollout", side, ctx.model, cfg.resolve), {})
    passes = measure_sides(sides, Workload.from_config(cfg), ctx.vocab_size, cfg.perf.warmup, repeats)
    tp = {s: [x["throughput_tok_s"] for x in passes if x["side"] == s] for s in sides}
    print(f"workload: {Workload.from_config(cfg).as_dict()}")
    print("| side | tok/s median | min | max | ratio to default (median of pairs) |\n|---|---|---|---|---|")
    for s, vals in tp.items():
        ratios = [v / d for v, d in zip(vals, tp["default"]) if d > 0]
        sp = spread(vals)
        print(f"| {s} | {sp['median']:.0f} | {min(vals):.0f} | {max(vals):.0f} | {spread(ratios)['median']:.3f} |")
    if "--json" in sys.argv:
        Path(sys.argv[sys.argv.index("--json") + 1]).write_text(json.dumps(
            [{k: v for k, v in x.items() if k != "requests"} for x in passes], indent=1, default=str))


if __name__ == "__main__":
    main()
