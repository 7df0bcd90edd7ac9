"""A stand-in for Triton's launcher (CPU, no triton): kernels launched from Python that compute outside torch's
dispatcher, so that tests can show the recorder finds such launches through its registry alone.

`FakeJIT` mirrors `triton.runtime.jit.JITFunction`'s launch surface: `kernel[grid](*args, **kwargs)` calls
`run(*args, grid=grid, warmup=False, **kwargs)`; a callable grid gets the bound arguments by name; the body
runs once per program id (`program_id()`, like `tl.program_id(0)`) on NumPy views of the tensors and writes its
output in place. Nothing in a launch is a torch operator on the values.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch

_PID = [0]


def program_id() -> int:
    return _PID[0]


class FakeJIT:
    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=False, **kwargs)

    def run(self, *args, grid, warmup, **kwargs):
        bound = inspect.signature(self.fn).bind(*args, **kwargs)
        bound.apply_defaults()
        if callable(grid):
            grid = grid(dict(bound.arguments))
        if warmup:
            return None
        views = {k: v.detach().numpy() if isinstance(v, torch.Tensor) else v for k, v in bound.arguments.items()}
        for pid in range(int(grid[0])):
            _PID[0] = pid
            self.fn(**views)
        return None


def _sum_squares(x: np.ndarray, block: int) -> np.float32:
    """float32 sum of squares in blocks of `block` columns, each block summed in order, then the blocks in order:
    the block size changes the association, hence the bits (a Triton kernel's BLOCK_SIZE does the same)."""
    total = np.float32(0)
    for start in range(0, x.shape[0], block):
        part = np.float32(0)
        for v in x[start:start + block]:
            part = np.float32(part + v * v)
        total = np.float32(total + part)
    return total


@FakeJIT
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK=64):
    """One row per program: out = x / sqrt(mean(x^2) + eps) * w, in float32."""
    row = program_id()
    x = x_ptr[row].astype(np.float32)
    mean = np.float32(_sum_squares(x, BLOCK) / np.float32(n_cols))
    inv = np.float32(1) / np.sqrt(np.float32(mean + np.float32(eps)))
    out_ptr[row] = (x * inv * w_ptr.astype(np.float32)).astype(out_ptr.dtype)


@FakeJIT
def rms_norm_kernel_pairs(x_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK=64):
    """The same norm, squares summed as two interleaved halves: another kernel, other bits."""
    row = program_id()
    x = x_ptr[row].astype(np.float32)
    mean = np.float32((_sum_squares(x[0::2], BLOCK) + _sum_squares(x[1::2], BLOCK)) / np.float32(n_cols))
    inv = np.float32(1) / np.sqrt(np.float32(mean + np.float32(eps)))
    out_ptr[row] = (x * inv * w_ptr.astype(np.float32)).astype(out_ptr.dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, kernel: FakeJIT = rms_norm_kernel, block: int = 64):
    """The Python wrapper a model calls (like vLLM's rms_norm_batch_invariant): flatten, allocate, launch."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(x2)
    kernel[lambda meta: (meta["x_ptr"].shape[0],)](x2, w, out, x2.shape[1], eps, BLOCK=block)
    return out.reshape(x.shape)
