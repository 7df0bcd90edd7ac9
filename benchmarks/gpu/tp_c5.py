"""C5's own measurement and judgement on a layout C0 refuses: a TP = 2 rollout against the one-GPU training
forward (issue 16). `tic gate C5` refuses TP > 1 before running (preflight); this script calls the gate's
measure and judge directly so the failure the refusal prevents is measured, not assumed.

  (two GPUs, after the vllm-bundle install)  python3 benchmarks/gpu/tp_c5.py x-moe-tp2.yaml OUT.json
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    from tic.gates import c5
    from tic.config.schema import load_config
    from tic.skill.context import GateContext

    cfg_path, out = sys.argv[1], sys.argv[2]
    ctx = GateContext(load_config(cfg_path))
    m = c5.measure(ctx)
    j = c5.judge(m)
    x = m.metrics
    rec = {"config": cfg_path, "rollout_parallel": ctx.cfg.rollout.parallel.describe(), "verdict": j.verdict,
           "reason": j.reason, "key": j.key_figure, "metrics": {k: v for k, v in x.items() if not isinstance(v, list)}}
    print(json.dumps(rec, indent=1, default=str))
    with open(out, "w") as f:
        json.dump(rec, f, indent=1, default=str)
    for eng in ctx._engines.values():
        getattr(eng, "close", lambda: None)()
    return 0


if __name__ == "__main__":
    sys.exit(main())
