"""What one RMSNorm launch costs on the GPU: rmsnorm-rows' Triton kernel against the norm vLLM's default compiled
mode runs (Inductor's code for the same arithmetic, torch.compile of vLLM's native add + RMSNorm), and vLLM's CUDA
kernels where vLLM is importable. No vLLM engine, no model: the norm calls of a decoder layer at given shapes.

  python benchmarks/gpu/row_norm_bench.py [--hidden 4096] [--heads 32:8:128] [--tokens 16384,2048,256,1]

Cases per token count: `add+norm` (the residual add and the layer norm, one launch), `norm` (no residual), and
`q/k heads` (the per-head query and key norms on slices of a fused qkv output, read in place by the row kernel).
Prints a table of microseconds per call (median of timed repeats, CUDA events) and the row kernel's time over
Inductor's. Timing only: the bits are norm_launch_probe.py's job.
"""

from __future__ import annotations

import argparse
import statistics


def timed_us(fn, repeats: int = 30, warmup: int = 5) -> float:
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    return statistics.median(times)


def native_add_norm(x, r, w, eps: float):
    """vLLM's native fused_add_rms_norm (vllm/ir/ops/layernorm.py): the arithmetic Inductor compiles."""
    import torch

    s = x.float() + r.float()
    res = s.to(x.dtype)
    y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    return (y.to(w.dtype) * w).to(x.dtype), res


def native_norm(x, w, eps: float):
    import torch

    s = x.float()
    y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    return (y.to(w.dtype) * w).to(x.dtype)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", default="32:8:128", help="query heads : key heads : head size")
    ap.add_argument("--tokens", default="16384,2048,256,1")
    a = ap.parse_args()
    import torch

    from tic.patches.vllm.rowwise_rmsnorm import rms_norm_rows

    try:
        import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)
        cuda_ops = torch.ops._C
    except ImportError:
        cuda_ops = None
    qh, kh, d = (int(v) for v in a.heads.split(":"))
    h, eps, dt = a.hidden, 1e-6, torch.bfloat16
    add_norm_c = torch.compile(native_add_norm, dynamic=True)
    norm_c = torch.compile(native_norm, dynamic=True)
    w = torch.randn(h, device="cuda", dtype=dt)
    wq, wk = torch.randn(d, device="cuda", dtype=dt), torch.randn(d, device="cuda", dtype=dt)
    rows = []
    for t in (int(v) for v in a.tokens.split(",")):
        x, r = torch.randn(t, h, device="cuda", dtype=dt), torch.randn(t, h, device="cuda", dtype=dt)
        qkv = torch.randn(t, (qh + 2 * kh) * d, device="cuda", dtype=dt)
        q = qkv[:, :qh * d].view(t, qh, d)
        k = qkv[:, qh * d:(qh + kh) * d].view(t, kh, d)
        xc, rc, out = x.clone(), r.clone(), torch.empty_like(x)  # vLLM's kernels write in place
        cases = {
            "add+norm": (lambda: rms_norm_rows(x, w, eps, r), lambda: add_norm_c(x, r, w, eps),
                         (lambda: cuda_ops.fused_add_rms_norm(xc, rc, w, eps)) if cuda_ops else None),
            "norm": (lambda: rms_norm_rows(x, w, eps), lambda: norm_c(x, w, eps),
                     (lambda: cuda_ops.rms_norm(out, x, w, eps)) if cuda_ops else None),
            "q/k heads": (lambda: (rms_norm_rows(q, wq, eps), rms_norm_rows(k, wk, eps)),
                          lambda: (norm_c(q, wq, eps), norm_c(k, wk, eps)), None),
        }
        for name, (rows_fn, inductor_fn, cuda_fn) in cases.items():
            us = [timed_us(rows_fn), timed_us(inductor_fn), timed_us(cuda_fn) if cuda_fn else None]
            rows.append((t, name, *us))
    print(f"| tokens | case (hidden {h}, heads {a.heads}) | row kernel us | Inductor us | vLLM CUDA us | rows / Inductor |")
    print("|---|---|---|---|---|---|")
    for t, name, ours, ind, cu in rows:
        cu_s = "-" if cu is None else f"{cu:.1f}"
        print(f"| {t} | {name} | {ours:.1f} | {ind:.1f} | {cu_s} | {ours / ind:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
