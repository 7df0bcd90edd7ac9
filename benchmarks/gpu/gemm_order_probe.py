"""Which tile shapes of tic's fixed-order GEMM give the same bits, and what each costs next to cuBLAS (GPU only).

Part 1 (bits): for each projection shape, every candidate tile computes x[:m] @ w.T for several m; a tile is in the
reference's class when every row equals the reference tile's rows of the full batch (torch.equal). Part 2 (time):
per shape and m, cuBLAS (F.linear), 128-row cuBLAS tiles (what gemm-fixed-m ran), and the fastest tile of the
reference class. Prints two tables and writes JSON to --out.

    . benchmarks/gpu/device_env.sh && python benchmarks/gpu/gemm_order_probe.py --out $OUT/gemm_probe.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

from tic.patches.vllm import fixed_order_gemm as fog

# (name, N, K): Qwen3-8B's projections and lm_head, Qwen3-30B-A3B's attention projections
SHAPES = [("8b.qkv", 6144, 4096), ("8b.o", 4096, 4096), ("8b.gate_up", 24576, 4096), ("8b.down", 4096, 12288),
          ("8b.lm_head", 151936, 4096), ("a3b.qkv", 5120, 2048), ("a3b.o", 2048, 4096)]
REFERENCE = (128, 256, 64, 8, 3)
CANDIDATES = sorted({REFERENCE} | {(bm, bn, bk, w, s) for bm, bn, bk, (w, s) in itertools.product(
    (16, 32, 64, 128), (32, 64, 128, 256), (32, 64, 128), ((4, 4), (8, 3))) if bm * bn <= 128 * 256 and bm + bn < 384})
# the tiles timed (those of the reference's class): a few per M range, as a table would choose among
TIMED = [(16, 32, 128, 4, 4), (16, 64, 128, 4, 4), (32, 32, 128, 4, 4), (32, 64, 128, 4, 4), (64, 32, 128, 4, 4),
         (64, 64, 64, 4, 4), (64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (64, 128, 128, 4, 4), (64, 256, 64, 8, 3),
         (128, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3)]
# TMA tiles (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), each run one program per tile and persistent
TMA_TILES = [(bm, bn, bk, w, st) for bm in (64, 128) for bn in (64, 128, 256) for bk in (64, 128)
             for w, st in ((4, 3), (4, 4), (8, 3), (8, 4)) if not (bn == 256 and bk == 128)] + \
            [(16, 64, 128, 4, 4), (32, 64, 128, 4, 4), (16, 128, 128, 4, 4), (32, 128, 64, 4, 4)]
ROWS = (1, 7, 64, 129, 1000)
TIMED_M = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def tiles_of_class(n, k, candidates, big=2048):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(big, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02)
    ref = fog.gemm(x, w, tile=REFERENCE)
    err = float((ref.float() - x.float() @ w.float().T).abs().max())  # a sanity check of the kernel, not a gate
    print(f"    reference tile vs float32 matmul: max |diff| {err:.3g}")
    same, differ = [], {}
    for t in candidates:
        try:
            bad = sum(int((fog.gemm(x[:m], w, tile=t) != ref[:m]).sum()) for m in ROWS + (big,))
        except Exception as e:  # a tile the compiler cannot build (shared memory): not a candidate
            differ[str(t)] = f"{type(e).__name__}"
            continue
        (same.append(t) if bad == 0 else differ.__setitem__(str(t), bad))
    return same, differ


def tma_class(n, k, big=2048):
    """TMA tiles (one program per tile and persistent) whose bits equal the pointer kernel's reference tile."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(big, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02)
    ref = fog.gemm(x, w, tile=REFERENCE)
    same, differ = [], {}
    for t, pers in itertools.product(TMA_TILES, (False, True)):
        try:
            bad = sum(int((fog.gemm_tma(x[:m], w, tile=t, persistent=pers) != ref[:m]).sum()) for m in ROWS + (big,))
        except Exception as e:
            differ[str((t, pers))] = f"{type(e).__name__}: {str(e)[:80]}"
            continue
        (same.append((t, pers)) if bad == 0 else differ.__setitem__(str((t, pers)), bad))
    return same, differ


def cublas_tiles(x, w, rows=128):
    out = x.new_empty((x.shape[0], w.shape[0]))
    pad = x.new_zeros((rows, x.shape[1]))
    for s in range(0, x.shape[0], rows):
        e = min(s + rows, x.shape[0])
        if e - s < rows:
            pad[: e - s].copy_(x[s:e])
            out[s:e] = F.linear(pad, w)[: e - s]
        else:
            out[s:e] = F.linear(x[s:e], w)
    return out


def bench(fn):
    return triton.testing.do_bench(fn, warmup=5, rep=20)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tma", action="store_true", help="the TMA kernels against the pointer kernel and cuBLAS")
    a = ap.parse_args()
    report = {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
              "reference": REFERENCE, "shapes": {}}
    print(f"{len(CANDIDATES)} candidate tiles; reference {REFERENCE}")
    if a.tma:
        return tma_main(a, report)
    for name, n, k in SHAPES:
        same, differ = tiles_of_class(n, k, CANDIDATES)
        print(f"[bits] {name} N={n} K={k}: {len(same)} tiles same as reference, {len(differ)} differ/unbuildable")
        for t, bad in list(differ.items())[:12]:
            print(f"    differs {t}: {bad}")
        rows = []
        g = torch.Generator(device="cuda").manual_seed(1)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        for m in TIMED_M:
            if name.endswith("lm_head") and m > 1024:
                continue
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
            t_cublas = bench(lambda: F.linear(x, w))
            t_tiles = bench(lambda: cublas_tiles(x, w))
            timed = {}
            for t in [t for t in TIMED if t in same] or same[:1]:
                timed[t] = bench(lambda t=t: fog.gemm(x, w, tile=t))
            best = min(timed, key=timed.get)
            table = fog.tile_for(m)
            t_table = timed.get(table, float("nan"))
            rows.append({"m": m, "cublas_ms": t_cublas, "tiles128_ms": t_tiles, "best_tile": best,
                         "best_ms": timed[best], "table_tile": table, "table_ms": t_table,
                         "all": {str(t): v for t, v in sorted(timed.items(), key=lambda kv: kv[1])}})
            print(f"[time] {name:12s} m={m:5d} cublas {t_cublas*1e3:8.1f}us  tiles128 {t_tiles*1e3:8.1f}us "
                  f"({t_cublas/t_tiles:.2f})  best {timed[best]*1e3:8.1f}us ({t_cublas/timed[best]:.2f}) {best}  "
                  f"table {t_table*1e3:8.1f}us ({t_cublas/t_table:.2f})", flush=True)
        report["shapes"][name] = {"n": n, "k": k, "same": same, "differ": differ, "times": rows}
        a.out.write_text(json.dumps(report, indent=1, default=str))
    return 0


def tma_main(a, report) -> int:
    for name, n, k in SHAPES:
        same, differ = tma_class(n, k)
        if not same:
            print(f"[bits] {name}: no TMA tile has the reference's bits")
        print(f"[bits] {name} N={n} K={k}: {len(same)} TMA tiles same as the pointer reference, {len(differ)} not")
        for t, bad in list(differ.items())[:8]:
            print(f"    not {t}: {bad}")
        g = torch.Generator(device="cuda").manual_seed(1)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        rows = []
        for m in (1, 64, 256, 1024, 4096, 8192):
            if name.endswith("lm_head") and m > 1024:
                continue
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
            t_cublas = bench(lambda: F.linear(x, w))
            ptr = {t: bench(lambda t=t: fog.gemm(x, w, tile=t)) for t in TIMED}
            tma = {tp: bench(lambda tp=tp: fog.gemm_tma(x, w, tile=tp[0], persistent=tp[1])) for tp in same
                   if (tp[0][0] <= 64) == (m <= 256) or tp[0][0] == 64}
            bp, bt = min(ptr, key=ptr.get), (min(tma, key=tma.get) if tma else None)
            rows.append({"m": m, "cublas_ms": t_cublas, "ptr_best": bp, "ptr_ms": ptr[bp], "tma_best": bt,
                         "tma_ms": tma.get(bt), "tma_all": {str(t): v for t, v in sorted(tma.items(), key=lambda kv: kv[1])[:10]}})
            print(f"[time] {name:12s} m={m:5d} cublas {t_cublas*1e3:8.1f}us  ptr {ptr[bp]*1e3:8.1f}us "
                  f"({t_cublas/ptr[bp]:.2f}) {bp}  tma {tma[bt]*1e3 if bt else float('nan'):8.1f}us "
                  f"({t_cublas/tma[bt] if bt else float('nan'):.2f}) {bt}", flush=True)
        report["shapes"][name] = {"n": n, "k": k, "tma_same": same, "tma_differ": differ, "times": rows}
        a.out.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
