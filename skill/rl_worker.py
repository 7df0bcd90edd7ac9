"""The fresh process C9 restores a checkpoint in: `python -m tic.skill.rl_worker JOB.json`.

JOB.json holds the config (as the parent process had it), the checkpoint and the output directory; the worker
builds its own engines, runs the first step after restore and writes result.json beside its tensors.
TIC_PRELOAD (comma-separated module names) is imported first: instrumentation or a planted fault for tests.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path


def main(job_path: str) -> int:
    for name in filter(None, os.environ.get("TIC_PRELOAD", "").split(",")):
        importlib.import_module(name.strip())
    from tic.core.errors import TicInputError
    from tic.core.fsio import atomic_write_text
    from tic.harness.measure.rl import restored_step
    from tic.config.schema import parse_config
    from tic.skill.context import GateContext

    job = json.loads(Path(job_path).read_text())
    try:
        cfg = parse_config(job["config"], Path(job["base_dir"]), "C9 restore job")
        ctx = GateContext(cfg)
        out = Path(job["out"])
        res = restored_step(ctx.private_engine("rollout", "C9"), ctx.private_engine("train", "C9"),
                            Path(job["checkpoint"]), ctx.prompts, ctx.sampling, cfg.training.lr, out)
    except TicInputError as e:
        print(f"tic: error: {e}", file=sys.stderr)
        return 2
    atomic_write_text(out / "result.json", json.dumps(res, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
