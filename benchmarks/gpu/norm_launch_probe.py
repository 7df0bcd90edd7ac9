"""Does a row's RMSNorm depend on how many rows share its launch? vLLM's `_C.rms_norm` and `_C.fused_add_rms_norm`
on the GPU, each row computed in launches of few rows (a decode step) and inside one launch of many (a prefill or a
training forward), compared bit for bit.

  python benchmarks/gpu/norm_launch_probe.py [--patched | --row-kernel] [--rows 4096] [--small 48]

Without a flag the kernels are called as vLLM calls them; --patched goes through tic's rmsnorm-fixed-block patch,
--row-kernel through rmsnorm-rows' Triton kernel, which also gets per-head rows (head sizes 64, 128, 256) read
in place from a fused qkv projection's slices, compared with the same rows copied out (that probe needs no vLLM).
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
    ap.add_argument("--row-kernel", action="store_true")
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--small", type=int, default=48)
    a = ap.parse_args()
    import torch

    if a.row_kernel:  # tic's Triton code alone: this probe runs without vLLM
        from tic.patches.vllm.rowwise_rmsnorm import rms_norm_rows

        def rms(out, x, w, eps):
            out.copy_(rms_norm_rows(x, w, eps))

        def fused(x, r, w, eps):
            y, res = rms_norm_rows(x, w, eps, r)
            x.copy_(y)
            r.copy_(res)
    else:
        import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)

        from tic.patches.vllm import rmsnorm_fixed_block as fixed

        rms = fixed.rms_norm_fixed_block if a.patched else torch.ops._C.rms_norm
        fused = fixed.fused_add_rms_norm_fixed_block if a.patched else torch.ops._C.fused_add_rms_norm

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
    if a.row_kernel:
        differ += strided_heads(rms_norm_rows, a.rows, a.small, g)
    side = "row kernel" if a.row_kernel else "patched" if a.patched else "stock"
    print(f"{side}: {differ} rows differ in all")
    return 1 if differ else 0


def strided_heads(norm, rows: int, small: int, g) -> int:
    """Per-head rows as a q/k norm reads them (a view of 8 query heads of a fused qkv output, row stride 12 heads)
    against the same rows copied out, in one launch and in launches of `small` tokens: rows that differ."""
    import torch

    differ = 0
    for h in (64, 128, 256):
        qkv = torch.randn(rows, 12 * h, device="cuda", generator=g).to(torch.bfloat16)
        w = (1 + 0.1 * torch.randn(h, device="cuda", generator=g)).to(torch.bfloat16)
        q = qkv[:, 4 * h:].view(rows, 8, h)
        copied = norm(q.contiguous(), w, 1e-6)
        whole = norm(q, w, 1e-6)
        parts = torch.cat([norm(q[s:s + small], w, 1e-6) for s in range(0, rows, small)])
        bad = int(((whole != copied) | (parts != copied)).any(dim=-1).sum())
        differ += bad
        print(f"{'per-head, strided':<20} {h:>6} {'bfloat16':<9} {bad} of {rows * 8}")
    return differ


if __name__ == "__main__":
    sys.exit(main())
