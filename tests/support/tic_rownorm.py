"""A CPU stand-in for a GPU RMSNorm kernel whose reduction order depends on the launch's row count, with vLLM's
`_C.rms_norm(Tensor! result, Tensor input, Tensor weight, float epsilon)` calling convention.

Like vLLM's CUDA rms_norm, each row's sum of squares is split over a block of "threads" chosen from the launch:
many threads for a launch of few rows (a decode step), fewer for many rows (a prefill or a training forward).
Each thread sums its own strided slice of the row, then the partial sums are added in a tree. The same row thus
gets other bits depending on how many rows share its launch, though its own values are identical.
Importing this module registers the op (a fresh repro process imports it by the namespace's name)."""

import torch
from torch.library import Library

FEW_ROWS = 4  # launches with fewer rows get the wide block
_lib = Library("tic_rownorm", "DEF")
_lib.define("rms_norm(Tensor(a!) result, Tensor input, Tensor weight, float epsilon) -> ()")


def threads_for(rows: int, hidden: int) -> int:
    return max(1, min(hidden // 4, 8 if rows < FEW_ROWS else 2))


def _tree_sum(parts: torch.Tensor) -> torch.Tensor:
    """parts [rows, n] summed pairwise, as a block reduction does."""
    while parts.shape[-1] > 1:
        if parts.shape[-1] % 2:
            parts = torch.cat([parts, torch.zeros_like(parts[..., :1])], dim=-1)
        parts = parts[..., 0::2] + parts[..., 1::2]
    return parts[..., 0]


def _rms_norm(result, input, weight, epsilon):
    x = input.float()
    rows, hidden = x.shape[0], x.shape[-1]
    n = threads_for(rows, hidden)
    sq = x * x
    partial = torch.stack([sq[..., t::n].sum(-1) for t in range(n)], dim=-1)  # thread t: elements t, t+n, ...
    var = _tree_sum(partial.reshape(-1, n)).reshape(*x.shape[:-1], 1) / hidden
    result.copy_((x * torch.rsqrt(var + epsilon)).to(input.dtype) * weight)


_lib.impl("rms_norm", _rms_norm, "CPU")


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """As tic's vLLM provider calls `_C.rms_norm`: rows flattened, a fresh output buffer."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    torch.ops.tic_rownorm.rms_norm(out, rows, w, eps)
    return out.reshape(x.shape)
