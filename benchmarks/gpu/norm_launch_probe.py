"""Does a row's RMSNorm depend on how many rows share its launch? vLLM's `_C.rms_norm` and `_C.fused_add_rms_norm`
on the GPU, each row computed in launches of few rows (a decode step) and inside one launch of many (a prefill or a
training forward), compared bit for bit.

  python benchmarks/gpu/norm_launch_probe.py [--patched] [--rows 4096] [--small 48]

Without --patched the kernels are called as vLLM calls them; with it through tic's rmsnorm-fixed-block patch.
Rows are drawn as residual-stream activations are (normal, per-feature scales spread over three decades), in
bf16 and float32. Prints one line per (kernel, hidden, dtype): rows that differ out of those compared. Exits 1
when any row differs, 0 when none does: the repro of the launch-shape dependence, fresh process each way.
"""

from __future__ import annotations

import argparse
import sys

HIDDEN = (2048, 2560, 3584, 4096, 5120, 8192)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--patched", action="store_true")
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--small", type=int, default=48)
    a = ap.parse_args()
    import torch
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)

    from tic.patches.vllm import rmsnorm_fixed_block as fixed

    if a.patched:
        rms = fixed.rms_norm_fixed_block
        fused = fixed.fused_add_rms_norm_fixed_block
    else:
        rms = torch.ops._C.rms_norm
        fused = torch.ops._C.fused_add_rms_norm

    def norm_rows(x, w, r):
        out = torch.empty_like(x)
        rms(out, x, w, 1e-6)
        return out

    def fused_rows(x, w, r):
        x2, r2 = x.clone(), r.clone()
        fused(x2, r2, w, 1e-6)
        return torch.cat([x2, r2], dim=1)

    g = torch.Generator(device="cuda").manual_seed(0)
    differ = 0
    print(f"{'kernel':<20} {'hidden':>6} {'dtype':<9} rows differing ({a.small}-row launches vs one {a.rows}-row launch)")
    for kernel, fn in (("_C.rms_norm", norm_rows), ("_C.fused_add_rms_norm", fused_rows)):
        for h in HIDDEN:
            for dtype in (torch.bfloat16, torch.float32):
                scale = torch.logspace(-1.5, 1.5, h, device="cuda")[torch.randperm(h, device="cuda", generator=g)]
                x = (torch.randn(a.rows, h, device="cuda", generator=g) * scale).to(dtype)
                r = (torch.randn(a.rows, h, device="cuda", generator=g) * scale).to(dtype)
                w = (1 + 0.1 * torch.randn(h, device="cuda", generator=g)).to(dtype)
                whole = fn(x, w, r)
                parts = torch.cat([fn(x[s:s + a.small].clone(), w, r[s:s + a.small].clone())
                                   for s in range(0, a.rows, a.small)])
                bad = int((whole != parts).any(dim=1).sum())
                differ += bad
                print(f"{kernel:<20} {h:>6} {str(dtype).removeprefix('torch.'):<9} {bad} of {a.rows}")
    print(f"{'patched' if a.patched else 'stock'}: {differ} rows differ in all")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
