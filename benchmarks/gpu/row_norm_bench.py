"""What one RMSNorm launch costs on the GPU: rmsnorm-rows' Triton kernel against the norm vLLM's default compiled
mode runs (Inductor's code for the same arithmetic, torch.compile of vLLM's native add + RMSNorm), and vLLM's CUDA
kernels where vLLM is importable. No vLLM engine, no model: the norm calls of a decoder layer at given shapes.

  python benchmarks/gpu/row_norm_bench.py [--hidden 4096] [--heads 32:8:128] [--tokens 16384,2048,256,1]

Cases per token count: `add+norm` (the residual add and the layer norm, one launch), `norm` (no residual), and
`q/k heads` (the per-head query and key norms on slices of a fused qkv output, read in place by the row kernel).
Prints a table of GPU microseconds per call (calls captured in a CUDA graph, the median of its timed replays) and
the row kernel's time over Inductor's. Timing only: the bits are norm_launch_probe.py's job.
"""

from __future__ import annotations

import argparse
import statistics


def timed_us(fn, calls: int = 20, repeats: int = 15) -> float:
    """GPU microseconds per call: `calls` calls captured in one CUDA graph, replayed `repeats` times (median), so
    the host's launch overhead, which a decode step's graph does not pay either, stays out."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compilation, autotuning) outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / calls)
    return statistics.median(times)


def _cell(fn):
    """A case's time, None where there is nothing to time, or the error's type where it could not be timed."""
    if fn is None:
        return None
    try:
        return timed_us(fn)
    except Exception as e:  # one case that cannot be captured must not lose the table
        return f"{type(e).__name__}"


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.1f}" if isinstance(v, float) else v


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
            rows.append((t, name, *(_cell(f) for f in (rows_fn, inductor_fn, cuda_fn))))
    print(f"| tokens | case (hidden {h}, heads {a.heads}) | row kernel us | Inductor us | vLLM CUDA us | rows / Inductor |")
    print("|---|---|---|---|---|---|")
    for t, name, ours, ind, cu in rows:
        ratio = f"{ours / ind:.2f}" if isinstance(ours, float) and isinstance(ind, float) else "-"
        print(f"| {t} | {name} | {_fmt(ours)} | {_fmt(ind)} | {_fmt(cu)} | {ratio} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
