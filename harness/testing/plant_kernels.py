"""CPU stand-ins for GPU kernels whose arithmetic follows the launch, not the row: torch.ops.plant_kernels.

vLLM's CUDA `rms_norm` picks its threads per row from the launch's row count, and each thread sums its own
strided slice of the row before the partial sums are added in a tree; a decode step (few rows) and a prefill
(many rows) thus reduce one row's squares in different orders. `plant_kernels::rms_norm` does that on CPU, with
vLLM's `_C.rms_norm(Tensor! result, Tensor input, Tensor weight, float epsilon)` calling convention, so that
tests and the plant benchmark (tic.harness.testing.plants) reach the locator's "same operator, the traced token's
arguments bit-identical, different bits" path the way the GPU does. `plant_kernels::linear` is a GEMM whose
reduction order follows its weight's address (a CPU GEMV kernel peels a prologue until its loads are aligned), so
a weight holding the same bits at another alignment gives other bits on every CPU, whatever GEMM path its ISA takes.
Importing this module registers the ops (a fresh repro process imports them by the namespace's name,
tic.harness.locate.repro.op_imports).
"""

from __future__ import annotations

import torch
from torch.library import Library

BLOCKS = ((5, 8), (17, 4))  # a launch of fewer than 5 rows: 8 partial sums per row; fewer than 17: 4; else 2

_lib = Library("plant_kernels", "DEF")
_lib.define("rms_norm(Tensor(a!) result, Tensor input, Tensor weight, float epsilon) -> ()")
_lib.define("linear(Tensor input, Tensor weight) -> Tensor")
ALIGNMENT = 64  # bytes: a weight starting on such a boundary is reduced in one pass, any other in two


def threads_for(rows: int, hidden: int) -> int:
    """Partial sums per row: many for a launch of few rows, fewer for many rows."""
    return max(1, min(hidden // 4, next((n for below, n in BLOCKS if rows < below), 2)))


def _tree_sum(parts: torch.Tensor) -> torch.Tensor:
    """parts [rows, n] summed pairwise, as a block reduction does."""
    while parts.shape[-1] > 1:
        if parts.shape[-1] % 2:
            parts = torch.cat([parts, torch.zeros_like(parts[..., :1])], dim=-1)
        parts = parts[..., 0::2] + parts[..., 1::2]
    return parts[..., 0]


def _rms_norm(result, input, weight, epsilon):
    x = input.float()
    hidden = x.shape[-1]
    n = threads_for(x.shape[0], hidden)
    sq = x * x
    partial = torch.stack([sq[..., t::n].sum(-1) for t in range(n)], dim=-1)  # thread t: elements t, t+n, ...
    var = _tree_sum(partial.reshape(-1, n)).reshape(*x.shape[:-1], 1) / hidden
    result.copy_(weight * (x * torch.rsqrt(var + epsilon)).to(input.dtype))


_lib.impl("rms_norm", _rms_norm, "CPU")


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """As tic's vLLM provider calls `_C.rms_norm`: every row of x in one launch, into a fresh output buffer."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    torch.ops.plant_kernels.rms_norm(out, rows, w, eps)
    return out.reshape(x.shape)


_wrapper = Library("plant_wrapper", "DEF")  # a wrapper op as vLLM's IR ops are: the locator opens it
_wrapper.define("rms_norm(Tensor x, Tensor weight, float epsilon) -> Tensor")


def _wrapped_rms_norm(x, weight, epsilon):
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)  # as vLLM's vllm_c rms_norm allocates its output
    torch.ops.plant_kernels.rms_norm(out, x, weight, epsilon)
    return out


_wrapper.impl("rms_norm", _wrapped_rms_norm, "CPU")


def rms_norm_in_wrapper(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm through a wrapper op that allocates the output buffer itself (vLLM 0.26's `vllm_ir.rms_norm`)."""
    rows = x.reshape(-1, x.shape[-1])
    return torch.ops.plant_wrapper.rms_norm(rows, w, eps).reshape(x.shape)


def _linear(input, weight):
    x, w = input.float(), weight.float()
    k = (ALIGNMENT - weight.data_ptr() % ALIGNMENT) % ALIGNMENT // weight.element_size()
    k = min(k, w.shape[1])  # the peeled prologue: the columns before the first aligned load

    def row(r):  # one row at a time, so that no row's bits follow the launch's row count
        return r @ w.T if k == 0 else r[:, :k] @ w[:, :k].T + r[:, k:] @ w[:, k:].T

    return torch.cat([row(r) for r in x.split(1)]).to(input.dtype)


_lib.impl("linear", _linear, "CPU")


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """A tic provider's `linear(x, w, b)`: every row of x in one launch of the alignment-following GEMM."""
    out = torch.ops.plant_kernels.linear(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])
    return out if b is None else out + b
