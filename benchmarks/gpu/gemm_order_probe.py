"""Which tiles of tic's fixed-order GEMM give the same bits, and what each costs next to cuBLAS (GPU only, no vLLM).

Part 1 (bits): for each projection shape, every candidate tile (pointer loads or TMA, one program per tile or
persistent) computes x[:m] @ w.T for several m; a tile is in the reference's class when every row equals the
reference tile's rows of the full batch (torch.equal). Part 2 (time): per shape and m, cuBLAS (F.linear), 128-row
cuBLAS tiles (what gemm-fixed-m ran), the fastest pointer and TMA tiles of the reference class, and the tile the
patch itself picks (fixed_order_gemm.tile_for). Prints both and writes JSON to --out.

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
from tic.patches.vllm.fixed_order_gemm import REFERENCE, Tile

# (name, N, K): Qwen3-8B's projections and lm_head, Qwen3-30B-A3B's attention projections
SHAPES = [("8b.qkv", 6144, 4096), ("8b.o", 4096, 4096), ("8b.gate_up", 24576, 4096), ("8b.down", 4096, 12288),
          ("8b.lm_head", 151936, 4096), ("a3b.qkv", 5120, 2048), ("a3b.o", 2048, 4096)]
POINTER = [Tile(bm, bn, bk, w, s, tma=False) for bm, bn, bk, (w, s) in itertools.product(
    (16, 32, 64, 128), (32, 64, 128, 256), (32, 64, 128), ((4, 4), (8, 3))) if bm + bn < 384]
TMA = [Tile(bm, bn, bk, w, s, persistent=p) for bm, bn, bk, (w, s), p in itertools.product(
    (16, 32, 64, 128), (64, 128, 256), (64, 128), ((4, 3), (4, 4), (8, 3), (8, 4)), (False, True))
    if not (bn == 256 and bk == 128) and (bm >= 64 or (w, s) == (4, 4))]
ROWS = (1, 7, 64, 129, 1000, 2048)
# the tiles timed: the patch's own candidates (what it chooses among) and the reference
TIMED = list(dict.fromkeys([REFERENCE, *(t for _, tiles in fog.CANDIDATES for t in tiles)]))
TIMED_M = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def same_class(n: int, k: int) -> tuple[list[Tile], dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(ROWS[-1], k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    ref = fog.run(x, w, None, REFERENCE)
    err = float((ref.float() - x.float() @ w.float().T).abs().max())  # a sanity check of the kernel, not a gate
    print(f"    reference tile vs float32 matmul: max |diff| {err:.3g}")
    same, differ = [], {}
    for t in POINTER + TMA:
        try:
            bad = sum(int((fog.run(x[:m], w, None, t) != ref[:m]).sum()) for m in ROWS)
        except Exception as e:  # a tile the compiler cannot build (shared memory): not a candidate  # noqa: BLE001
            differ[str(t)] = f"{type(e).__name__}: {str(e)[:80]}"
            continue
        (same.append(t) if bad == 0 else differ.__setitem__(str(t), bad))
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


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=20)


def timings(name: str, n: int, k: int, same: list[Tile]) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    rows = []
    for m in TIMED_M:
        if m * n > (1 << 30):  # the lm_head's logits past a GiB: not a decode or prefill this benchmark models
            continue
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        base = bench(lambda: F.linear(x, w))
        t = {tile: bench(lambda tile=tile: fog.run(x, w, None, tile)) for tile in TIMED if tile in same}
        best = {kind: min((tt for tt in t if tt.tma == tma), key=t.get, default=None)
                for kind, tma in (("pointer", False), ("tma", True))}
        chosen = fog.tile_for(m, w, x.dtype, False)
        t_chosen = t.get(chosen) or bench(lambda: fog.run(x, w, None, chosen))
        row = {"m": m, "cublas_ms": base, "tiles128_ms": bench(lambda: cublas_tiles(x, w)), "chosen": chosen,
               "chosen_ms": t_chosen, **{f"{kind}_best": b for kind, b in best.items()},
               **{f"{kind}_ms": t.get(b) for kind, b in best.items()}}
        rows.append(row)
        ratio = lambda ms: f"{base / ms:.2f}" if ms else "-"  # noqa: E731
        print(f"[time] {name:12s} m={m:5d} cublas {base * 1e3:8.1f}us  tiles128 {ratio(row['tiles128_ms'])}  "
              f"pointer {ratio(row['pointer_ms'])} {best['pointer']}  tma {ratio(row['tma_ms'])} {best['tma']}  "
              f"chosen {ratio(t_chosen)} {chosen}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    report = {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
              "reference": REFERENCE, "shapes": {}}
    print(f"{len(POINTER)} pointer and {len(TMA)} TMA tiles; reference {REFERENCE}")
    for name, n, k in SHAPES:
        same, differ = same_class(n, k)
        print(f"[bits] {name} N={n} K={k}: {len(same)} tiles same as the reference, {len(differ)} differ or "
              "do not build")
        for t, bad in list(differ.items())[:12]:
            print(f"    {t}: {bad}")
        report["shapes"][name] = {"n": n, "k": k, "same": same, "differ": differ,
                                  "times": timings(name, n, k, same)}
        a.out.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
