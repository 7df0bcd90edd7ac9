"""RMSNorm with one Triton program per row: the float32 sum of squares of a row is reduced by the same fixed tree
whatever the number of rows in the launch.

It computes what vLLM's native IR implementation of `rms_norm` / `fused_add_rms_norm` computes (vllm/ir/ops/
layernorm.py): x in float32 (plus the residual, which is stored rounded to the input dtype), x * rsqrt(mean(x^2)
+ eps), rounded to the weight's dtype and multiplied by the weight there, then rounded to the input dtype. vLLM
runs that native code whenever its CUDA kernel cannot take the arguments, e.g. Gemma's norm, whose weight is the
float32 (1 + w). The native code reduces with PyTorch's generic reduction, whose split of a row over threads and
blocks follows the tensor's shape, so a row's sum of squares, hence its output, changes with the batch's row
count. Here the reduction depends only on the row's length (block size and warps are chosen from it).
"""

from __future__ import annotations

import functools


@functools.cache
def _kernel():
    """Compiled on first use (tic imports this module on machines without Triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _rms_rows(x_ptr, r_ptr, w_ptr, y_ptr, ro_ptr, H, sx, sr, sy, sro, eps,
                  HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        x = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            x += tl.load(r_ptr + row * sr + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(ro_ptr + row * sro + cols, x.to(ro_ptr.dtype.element_ty), mask=mask)
        var = tl.sum(x * x, axis=0) / H
        y = x * tl.math.rsqrt(var + eps)
        if HAS_WEIGHT:
            w = tl.load(w_ptr + cols, mask=mask, other=0.0)
            y = (y.to(w_ptr.dtype.element_ty).to(tl.float32) * w.to(tl.float32)).to(w_ptr.dtype.element_ty)
        tl.store(y_ptr + row * sy + cols, y.to(y_ptr.dtype.element_ty), mask=mask)

    return _rms_rows


def rows_2d(t):
    """t as [rows, last dimension] with unit stride along a row and 16-byte-aligned rows (a view where it can be).
    Triton specializes a kernel on its pointers' and strides' 16-byte divisibility, and the vector width it then
    gives each thread changes a row's reduction order: one alignment for every call keeps one order."""
    import torch

    h = t.shape[-1]
    t2 = t.reshape(-1, h)
    if t2.stride(-1) != 1 or t2.data_ptr() % 16 or (t2.stride(0) * t2.element_size()) % 16:
        t2 = t2.clone(memory_format=torch.contiguous_format) if t2.stride(-1) == 1 else t2.contiguous()
    return t2


def row_launch(h: int) -> tuple[int, int]:
    """(block, warps) of a one-program-per-row kernel over rows of h elements: fixed by h alone."""
    import triton

    block = triton.next_power_of_2(h)
    return block, min(16, max(1, block // 256))


def rms_norm_rows(x, weight, epsilon: float, residual=None):
    """The normed rows of x (x's shape and dtype); with a residual, (normed rows of x + residual, x + residual
    rounded to x's dtype). Any leading shape and row stride; the last dimension is normalised."""
    import torch

    h = x.shape[-1]
    x2 = rows_2d(x)
    r2 = rows_2d(residual) if residual is not None else None
    weight = rows_2d(weight).view(weight.shape) if weight is not None else None
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    ro = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if residual is not None else y
    if x2.shape[0]:
        block, warps = row_launch(h)
        _kernel()[(x2.shape[0],)](
            x2, r2 if r2 is not None else x2, weight if weight is not None else x2, y, ro, h,
            x2.stride(0), (r2 if r2 is not None else x2).stride(0), y.stride(0), ro.stride(0), epsilon,
            HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, BLOCK=block,
            num_warps=warps)
    if residual is None:
        return y.view(x.shape)
    return y.view(x.shape), ro.view(x.shape)
