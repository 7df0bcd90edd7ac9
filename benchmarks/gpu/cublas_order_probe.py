"""Does cuBLAS, at a given number of rows, sum K in the fixed-order GEMM's order? (GPU only, no vLLM.)

gemm-fixed-order runs every dense projection through tic's Triton GEMM because a row's bits must not depend on how
many rows share the call. cuBLAS picks its kernel by problem size: where it splits K (decode sizes) the order
changes, but a kernel that walks K in one MMA chain may give the Triton kernel's bits exactly. For each projection
shape and each m, this compares cuBLAS's rows (F.linear on x[:m]) with the reference tile's rows of the full
batch (torch.equal per m, and the count of differing elements), and times cuBLAS against the tile the patch picks.
Run it once per cuBLAS setting (the workspace and library are read when cuBLAS starts, so one process each):

    python benchmarks/gpu/cublas_order_probe.py --label default --out $OUT/cublas-default.json
    CUBLASLT_WORKSPACE_SIZE=0 CUBLAS_WORKSPACE_CONFIG=:0:0 python ... --label no-workspace --out ...
    python ... --blas cublaslt --label lt --out ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

from gemm_order_probe import SHAPES
from tic.patches.vllm import fixed_order_gemm as fog
from tic.patches.vllm.fixed_order_gemm import REFERENCE

ROWS = (1, 2, 3, 4, 7, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096,
        6144, 8192)


def probe(name: str, n: int, k: int, bench: bool) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    top = min(ROWS[-1], (1 << 30) // n)  # logits past a GiB are not a step this models
    x = torch.randn(top, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    ref = fog.run(x, w, None, REFERENCE)
    full = F.linear(x, w)
    rows = []
    for m in (r for r in ROWS if r <= top):
        y = F.linear(x[:m], w)
        row = {"m": m, "diff_vs_reference": int((y != ref[:m]).sum()),
               "diff_vs_cublas_full": int((y != full[:m]).sum()), "elements": m * n}
        if bench:
            chosen = fog.tile_for(m, w, x.dtype, False)
            xm = x[:m].contiguous()
            row["cublas_us"] = 1e3 * triton.testing.do_bench(lambda: F.linear(xm, w), warmup=5, rep=20)
            row["tic_us"] = 1e3 * triton.testing.do_bench(lambda: fog.run(xm, w, None, chosen), warmup=5, rep=20)
            row["tic_tile"] = str(chosen)
        rows.append(row)
        t = (f"  cublas {row['cublas_us']:8.1f}us  tic {row['tic_us']:8.1f}us  cublas/tic time "
             f"{row['cublas_us'] / row['tic_us']:.2f}") if bench else ""
        print(f"{name:11s} m={m:5d}  {'SAME' if not row['diff_vs_reference'] else 'differ':6s} "
              f"{row['diff_vs_reference']:9d}/{m * n:<10d} vs own full batch {row['diff_vs_cublas_full']:9d}{t}",
              flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--label", required=True)
    ap.add_argument("--blas", choices=("default", "cublas", "cublaslt"), default="default")
    ap.add_argument("--no-bench", action="store_true")
    a = ap.parse_args()
    if a.blas != "default":
        torch.backends.cuda.preferred_blas_library(a.blas)
    env = {v: os.environ.get(v) for v in ("CUBLASLT_WORKSPACE_SIZE", "CUBLAS_WORKSPACE_CONFIG")}
    report = {"label": a.label, "blas": str(torch.backends.cuda.preferred_blas_library()), "env": env,
              "torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
              "reference": str(REFERENCE), "shapes": {}}
    print(f"[{a.label}] blas {report['blas']} env {env}")
    for name, n, k in SHAPES:
        report["shapes"][name] = {"n": n, "k": k, "rows": probe(name, n, k, not a.no_bench)}
        a.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
