"""C7 on the GPU: the control, then planted wrong backwards that must fail it (issue 10).

  python benchmarks/gpu/c7_plants.py CONFIG.yaml [OUT.json]

Each plant changes one autograd surrogate's gradients (tic.harness.testing.backward_plants.planted_fault, in the
train engine's trainable model) or the weights between forward and backward; the forward values (vLLM's kernels)
are untouched. Prints one row per run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def main() -> None:
    from tic.gates import get
    from tic.harness.testing.backward_plants import planted_fault
    from tic.config.schema import load_config
    from tic.skill.context import GateContext
    from tic.skill.runner import run_gate

    cfg = load_config(Path(sys.argv[1]))
    cfg.locate.enabled = False
    ctx = GateContext(cfg)
    moe = "moe" in json.dumps(ctx.model_config)

    def bump(weights):
        for w in weights:
            w.add_(1e-3)

    plants = [("control", None, {}),
              ("rms_norm: sign flip", "rms_norm", {"grads": lambda g: (-g[0], *g[1:])}),
              ("add_rms_norm: residual gradient dropped", "add_rms_norm",
               {"grads": lambda g: (g[0], torch.zeros_like(g[1]), *g[2:])}),
              ("attention: sign flip", "attention", {"grads": lambda g: (-g[0], *g[1:])})]
    if moe:
        plants += [("moe_route: sign flip", "moe_route", {"grads": lambda g: (-g[0], *g[1:])}),
                   ("moe_experts: no gradient to routing weights", "moe_experts",
                    {"grads": lambda g: (g[0], torch.zeros_like(g[1]), *g[2:])})]
    plants.append(("linear: weights changed before backward", "linear", {"before": bump}))  # last: it edits them
    rows = []
    for label, op, kw in plants:
        if op is None:
            res = run_gate(get("C7"), ctx)
        else:
            with planted_fault(ctx.train_engine().trainable_model(), op, **kw):
                res = run_gate(get("C7"), ctx)
        expect = "pass" if op is None else "fail"
        rows.append({"plant": label, "verdict": res.verdict, "expected": expect, "key": res.key_figure,
                     "routing": (res.details or {}).get("routing")})
        print(f"| {label} | {res.verdict} (expected {expect}) | {res.key_figure} |", flush=True)
    if len(sys.argv) > 2:
        Path(sys.argv[2]).write_text(json.dumps(rows, indent=1, default=str))
    sys.exit(0 if all(r["verdict"] == r["expected"] for r in rows) else 1)


if __name__ == "__main__":
    main()
