"""RMSNorm by a Triton kernel whose float32 sum of squares of a row is reduced by the same fixed tree whatever the
number of rows in the launch, and whatever the rows' layout in memory.

It computes what vLLM's native IR implementation of `rms_norm` / `fused_add_rms_norm` computes (vllm/ir/ops/
layernorm.py): x in float32 (plus the residual, which is stored rounded to the input dtype), x * rsqrt(mean(x^2)
+ eps), rounded to the weight's dtype and multiplied by the weight there, then rounded to the input dtype. vLLM
runs that native code whenever its CUDA kernel cannot take the arguments, e.g. Gemma's norm, whose weight is the
float32 (1 + w). The native code reduces with PyTorch's generic reduction, whose split of a row over threads and
blocks follows the tensor's shape, so a row's sum of squares, hence its output, changes with the batch's row
count. Here the row length alone fixes the launch (block, rows per program, warps) and the alignment the kernel
assumes of every row; a row's position in the batch or in memory never enters its reduction. Strided rows (the
per-head query and key norms read slices of a fused projection) are read in place, without a copy.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

from tic.patches.vllm._triton_options import PINNED


@functools.cache
def _kernel():
    """Compiled on first use (tic imports this module on machines without Triton)."""
    import triton
    import triton.language as tl

    # Integer arguments are not specialised: Triton would otherwise compile another variant where a stride happens
    # to be a multiple of 16 or equal to 1, and a variant's vector width sets a row's reduction order. The only
    # alignment the kernel knows is ALIGN, which the row length fixes and the host guarantees. The row length H is
    # a compile-time constant like the launch it fixes: a runtime H would leave the column mask's extent unknown,
    # and Triton then loads and stores one element at a time.
    @triton.jit(do_not_specialize=["n_rows", "gx", "sxo", "sxi", "gr", "sro", "sri"])
    def _rms_rows(x_ptr, r_ptr, w_ptr, y_ptr, ro_ptr, n_rows, gx, sxo, sxi, gr, sro, sri, eps,
                  H: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr,
                  ROWS: tl.constexpr, ALIGN: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        mask = (rows < n_rows)[:, None] & (cols < H)[None, :]
        # row r of a grouped layout starts at (r // g) * outer + (r % g) * inner (g = 1: a plain row stride)
        xo = tl.multiple_of((rows // gx) * sxo + (rows % gx) * sxi, ALIGN)
        yo = tl.multiple_of(rows * H, ALIGN)  # the outputs are contiguous rows
        x = tl.load(x_ptr + xo[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            ro = tl.multiple_of((rows // gr) * sro + (rows % gr) * sri, ALIGN)
            x += tl.load(r_ptr + ro[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(ro_ptr + yo[:, None] + cols[None, :], x.to(ro_ptr.dtype.element_ty), mask=mask)
        var = tl.sum(x * x, axis=1) / H
        y = x * tl.math.rsqrt(var + eps)[:, None]
        if HAS_WEIGHT:
            w = tl.load(w_ptr + cols, mask=cols < H, other=0.0)
            y = (y.to(w_ptr.dtype.element_ty).to(tl.float32) * w.to(tl.float32)[None, :]).to(w_ptr.dtype.element_ty)
        tl.store(y_ptr + yo[:, None] + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)

    return _rms_rows


ROW_ELEMENTS = 2048  # a program's share of short rows (per-head q/k norms): several rows, fixed by the length


class RowLaunch(NamedTuple):
    """How the kernel runs rows of one length, fixed by that length alone: block (columns, a power of two), rows
    per program, warps, and the alignment (in elements) every row start must have."""
    block: int
    rows: int
    warps: int
    align: int


def rms_launch(h: int) -> RowLaunch:
    block = 1 << max(0, (h - 1).bit_length())
    rows = max(1, ROW_ELEMENTS // block)
    return RowLaunch(block, rows, min(16, max(1, rows * block // 256)), math.gcd(h, 16))


class Rows(NamedTuple):
    """A tensor's rows as the kernel addresses them: row r starts at (r // groups) * outer + (r % groups) * inner
    elements from tensor's start."""
    tensor: object
    groups: int
    outer: int
    inner: int


def grouped_rows(t, align: int) -> Rows:
    """t's rows (its last dimension) without a copy where a view can address them: any leading shape that
    flattens to one row stride, or to (rows, heads) with unit stride along a row, e.g. the per-head query and key
    slices of a fused qkv projection. Otherwise, or where a row start is not a multiple of `align` elements or
    the data not 16-byte aligned, a contiguous copy: every launch then has the alignment the kernel assumes."""
    import torch

    h = t.shape[-1]
    if t.dim() == 1:
        t = t.view(1, h)
    view = _view(t, (-1, h))
    if view is not None:
        rows = Rows(view, 1, view.stride(0), 0)
    else:
        view = _view(t, (-1, t.shape[-2], h))
        rows = Rows(view, view.shape[1], view.stride(0), view.stride(1)) if view is not None else None
    if rows is None or not _aligned(rows, align):
        view = t.clone(memory_format=torch.contiguous_format).view(-1, h)  # fresh, so aligned
        rows = Rows(view, 1, h, 0)
    return rows


def _view(t, shape):
    try:
        return t.view(shape)
    except RuntimeError:  # the strides do not flatten to this shape
        return None


def _aligned(rows: Rows, align: int) -> bool:
    t = rows.tensor
    return ((t.shape[-1] == 1 or t.stride(-1) == 1) and t.data_ptr() % 16 == 0 and rows.outer % align == 0
            and rows.inner % align == 0)


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
    rounded to x's dtype). Any leading shape and row strides; the last dimension is normalised. The outputs are
    contiguous."""
    import torch

    h = x.shape[-1]
    launch = rms_launch(h)
    xr = grouped_rows(x, launch.align)
    rr = grouped_rows(residual, launch.align) if residual is not None else xr
    if weight is not None and (weight.stride(-1) != 1 or weight.data_ptr() % 16):
        weight = weight.clone(memory_format=torch.contiguous_format)
    n = x.numel() // h if h else 0
    y = torch.empty((n, h), dtype=x.dtype, device=x.device)
    ro = torch.empty((n, h), dtype=x.dtype, device=x.device) if residual is not None else y
    if n:
        _kernel()[(-(-n // launch.rows),)](
            xr.tensor, rr.tensor, weight if weight is not None else y, y, ro, n, xr.groups, xr.outer, xr.inner,
            rr.groups, rr.outer, rr.inner, epsilon, H=h, HAS_RESIDUAL=residual is not None,
            HAS_WEIGHT=weight is not None, BLOCK=launch.block, ROWS=launch.rows, ALIGN=launch.align,
            num_warps=launch.warps, **PINNED)
    if residual is None:
        return y.view(x.shape)
    return y.view(x.shape), ro.view(x.shape)
