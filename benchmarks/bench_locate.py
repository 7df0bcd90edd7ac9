"""Benchmark: time to localise and forward passes, on the tiny models on CPU (target: <= 30 s each).

Cases: the embedded default's real failures (stock kernels: C4 decode vs prefill, C5 rollout vs train, C3
alone vs batch) and a planted divergence (one layer's RMSNorm eps on one side, consistent kernels).
Run: .venv/bin/python benchmarks/bench_locate.py  (writes artifacts under a temporary directory)
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # keep the table readable
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from tic.gates import get  # noqa: E402
from tic.harness.locate.hf_capture import HFCaptureRunner
from tic.harness.engines.hf import HFEngine
from tic.harness.locate import report
from tic.harness.locate.search import Side, locate, locate_for_gate
from tic.config.schema import load_config
from tic.skill.context import GateContext

ROOT = Path(__file__).resolve().parent.parent
TARGET_S = 30.0


def gate_case(cfg_path: Path, gate_id: str) -> dict:
    ctx = GateContext(load_config(cfg_path))
    measured = get(gate_id).measure(ctx)
    t0 = time.perf_counter()
    found = locate_for_gate(ctx, gate_id, measured)
    return {"case": f"{gate_id} embedded default (stock)", "seconds": time.perf_counter() - t0, **found}


def planted_case() -> dict:
    ctx = GateContext(load_config(ROOT / "examples/tiny-qwen3/tic-consistent.yaml"))
    a = HFEngine(ctx.model.dir, "float32", kernels="consistent")
    b = HFEngine(ctx.model.dir, "float32", kernels="consistent")
    b.model = copy.deepcopy(a.model)
    b.model.model.layers[2].post_attention_layernorm.variance_epsilon = 1e-5
    sp = ctx.sampling
    samples = a.generate(ctx.prompts, sp, list(range(len(ctx.prompts))))
    upto = sp.max_tokens - 1
    ra, rb = HFCaptureRunner(a), HFCaptureRunner(b)
    t0 = time.perf_counter()
    found = report.write(locate(Side("decode", ra, lambda s: ra.decode(samples, 0, upto, s)),
                                Side("train", rb, lambda s: rb.score(samples, 0, s)), Path("plant"), "plant", upto),
                         Path("plant"))
    return {"case": "planted eps, layer 2 (consistent)", "seconds": time.perf_counter() - t0, **found}


def main() -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.chdir(tempfile.mkdtemp(prefix="tic-bench-locate-"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, cwd {os.getcwd()}")
    rows = [gate_case(ROOT / "examples/tiny-qwen3/tic.yaml", g) for g in ("C4", "C5", "C3")] + [planted_case()]
    print(f"{'case':<38} {'seconds':>8} {'forwards':>8}  {'layer':<16} {'module':<40} {'operator':<44} repro rows")
    ok = True
    for r in rows:
        rc = r.get("repro_check") or {}
        print(f"{r['case']:<38} {r['seconds']:8.2f} {r['forward_passes']:8d}  {str(r['first_divergent_layer']):<16} "
              f"{str(r['culprit_module']):<40} {str(r['first_operator']):<44} "
              f"{'A %s / B %s' % (rc.get('rows_a'), rc.get('rows_b')) if rc.get('reproduces') else '-'}")
        ok &= r["seconds"] <= TARGET_S
    print(f"target <= {TARGET_S:.0f} s per localisation: {'met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
