"""Can a GEMM keep one K order for every M and still split K at decode sizes? (GPU only, no vLLM.)

tic's fixed-order GEMM walks K in one MMA chain per output tile, so at decode sizes (a few hundred rows) a weight
of N rows gives few tiles and the GPU is not filled, where cuBLAS splits K. A split is M-invariant too when it is
fixed by the weight: K cut into segments of SEG_K, each segment's chain started from zero, the float32 segment
sums added in segment order, then rounded once. Two launches compute that same value:
  - split: one program per (tile, segment) writes its float32 segment sum; a second kernel adds them in order;
  - chain: one program per tile walks the segments in turn and keeps a running float32 total (large M).
This probe checks the bits (split == chain on every row, and a row does not change with M, torch.equal) and
times both against cuBLAS and against the patch's single-chain tiles, per projection shape and M.

    . benchmarks/gpu/device_env.sh && python benchmarks/gpu/gemm_split_probe.py --out $OUT/gemm_split.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing

from tic.patches.vllm import fixed_order_gemm as fog

SHAPES = [("8b.qkv", 6144, 4096), ("8b.o", 4096, 4096), ("8b.gate_up", 24576, 4096), ("8b.down", 4096, 12288),
          ("a3b.qkv", 5120, 2048), ("a3b.o", 2048, 4096)]
ROWS = (1, 7, 64, 129, 256, 1000, 2048)
TIMED_M = (1, 64, 128, 256, 512, 1024, 8192)
SEG_K = 2048  # K per segment (half of K where K is not larger)
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
SPLIT_TILES = [(16, 32, 128, 4, 4), (16, 64, 128, 4, 4), (64, 32, 128, 4, 4), (64, 64, 128, 4, 4),
               (64, 128, 64, 4, 4), (64, 128, 128, 4, 4), (128, 128, 64, 8, 3)]
CHAIN_TILES = [(64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3)]


@triton.jit
def _segment_sum(x_ptr, w_ptr, rm, rn, M, N, K, k0, sxm, sxk, swn, swk, SEG: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # SEG // BLOCK_K steps from k0; steps past K load zeros (the last segment of a K that SEG does not divide)
    rk = k0 + tl.arange(0, BLOCK_K)
    rm64, rn64 = rm.to(tl.int64), rn.to(tl.int64)
    xt = x_ptr + rm64[:, None] * sxm + rk[None, :] * sxk
    wt = w_ptr + rn64[None, :] * swn + rk[:, None] * swk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    kk = tl.arange(0, BLOCK_K)
    for i in range(SEG // BLOCK_K):
        left = K - k0 - i * BLOCK_K
        a = tl.load(xt, mask=(rm[:, None] < M) & (kk[None, :] < left), other=0.0)
        b = tl.load(wt, mask=(rn[None, :] < N) & (kk[:, None] < left), other=0.0)
        acc = tl.dot(a, b, acc)
        xt += BLOCK_K * sxk
        wt += BLOCK_K * swk
    return acc


@triton.jit
def _tile_of(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    size_m = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    return pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit(do_not_specialize=["M"])
def _split_kernel(x_ptr, w_ptr, ws_ptr, M, N, K, sxm, sxk, swn, swk, SEG: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    rm, rn = _tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    s = tl.program_id(1)
    k0 = s * SEG
    acc = _segment_sum(x_ptr, w_ptr, rm, rn, M, N, K, k0, sxm, sxk, swn, swk, SEG, BLOCK_M, BLOCK_N, BLOCK_K)
    out = ws_ptr + s.to(tl.int64) * M * N + rm.to(tl.int64)[:, None] * N + rn[None, :]
    tl.store(out, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit(do_not_specialize=["M"])
def _reduce_kernel(ws_ptr, y_ptr, M, N, NSEG: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < M * N
    total = tl.load(ws_ptr + i, mask=ok, other=0.0)
    for s in range(1, NSEG):
        total = total + tl.load(ws_ptr + s * M * N + i, mask=ok, other=0.0)
    tl.store(y_ptr + i, total.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["M"])
def _chain_kernel(x_ptr, w_ptr, y_ptr, M, N, K, sxm, sxk, swn, swk, SEG: tl.constexpr, NSEG: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    rm, rn = _tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    total = _segment_sum(x_ptr, w_ptr, rm, rn, M, N, K, 0, sxm, sxk, swn, swk, SEG, BLOCK_M, BLOCK_N, BLOCK_K)
    for s in range(1, NSEG):
        total += _segment_sum(x_ptr, w_ptr, rm, rn, M, N, K, s * SEG, sxm, sxk, swn, swk, SEG, BLOCK_M, BLOCK_N,
                              BLOCK_K)
    out = y_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :]
    tl.store(out, total.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def split(x, w, seg, tile):
    bm, bn, bk, warps, stages = tile
    m, k = x.shape
    n = w.shape[0]
    nseg = -(-k // seg)
    ws = torch.empty((nseg, m, n), device=x.device, dtype=torch.float32)
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    _split_kernel[(-(-m // bm) * -(-n // bn), nseg)](
        x, w, ws, m, n, k, x.stride(0), x.stride(1), w.stride(0), w.stride(1), SEG=seg, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    _reduce_kernel[(-(-m * n // 1024),)](ws, y, m, n, NSEG=nseg, BLOCK=1024, num_warps=4)
    return y


def chain(x, w, seg, tile):
    bm, bn, bk, warps, stages = tile
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    _chain_kernel[(-(-m // bm) * -(-n // bn),)](
        x, w, y, m, n, k, x.stride(0), x.stride(1), w.stride(0), w.stride(1), SEG=seg, NSEG=-(-k // seg),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    return y


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=25)


def bits(n: int, k: int, seg: int) -> dict:
    """Every split and chain tile against the first chain tile on the full batch: rows of x[:m] for each m."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(ROWS[-1], k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    ref = chain(x, w, seg, CHAIN_TILES[0])
    out = {}
    for kind, fn, tiles in (("split", split, SPLIT_TILES), ("chain", chain, CHAIN_TILES)):
        for t in tiles:
            try:
                off = sum(int((fn(x[:m], w, seg, t) != ref[:m]).sum()) for m in ROWS)
            except Exception as e:  # noqa: BLE001  a tile that does not fit the device
                off = f"{type(e).__name__}"
            out[f"{kind}{t}"] = off
    return out


def timings(n: int, k: int, seg: int) -> list[dict]:
    rows = []
    g = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    for m in TIMED_M:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        r = {"m": m, "cublas": bench(lambda: F.linear(x, w))}
        single = {}
        for t in dict.fromkeys([fog.REFERENCE, *(t for _, ts in fog.CANDIDATES for t in ts)]):
            try:
                single[str(tuple(t))] = bench(lambda t=t: fog.run(x, w, None, t))
            except Exception:  # noqa: BLE001
                continue
        best = min(single, key=single.get)
        r["single"], r["single_tile"] = single[best], best
        for kind, fn, tiles in (("split", split, SPLIT_TILES), ("chain", chain, CHAIN_TILES)):
            if kind == "split" and m > 1024:
                continue  # its float32 segment sums grow with M: a decode-size launch
            times = {}
            for t in tiles:
                try:
                    times[str(t)] = bench(lambda t=t, fn=fn: fn(x, w, seg, t))
                except Exception:  # noqa: BLE001
                    continue
            if times:
                b = min(times, key=times.get)
                r[kind], r[f"{kind}_tile"] = times[b], b
        rows.append(r)
        parts = " ".join(f"{key} {r[key] * 1e3:7.1f} ({r['cublas'] / r[key]:.2f})"
                         for key in ("single", "split", "chain") if key in r)
        print(f"    m {m:5d} cublas {r['cublas'] * 1e3:7.1f} us | {parts}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    args = ap.parse_args()
    wanted = args.shapes.split(",")
    result = {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
              "shapes": {}}
    for name, n, k in SHAPES:
        if name not in wanted:
            continue
        for seg in (SEG_K if SEG_K < k else k // 2,):
            print(f"{name} N={n} K={k} SEG_K={seg}", flush=True)
            b = bits(n, k, seg)
            off = {t: v for t, v in b.items() if v != 0}
            print(f"    bits: {len(b) - len(off)}/{len(b)} tiles equal the chain on every row; off: {off}", flush=True)
            result["shapes"][f"{name}@{seg}"] = {"n": n, "k": k, "seg": seg, "bits": b, "times": timings(n, k, seg)}
            args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
