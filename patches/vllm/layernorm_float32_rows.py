"""Cohere's float32 LayerNorm (vLLM's `commandr.layer_norm_func`) with one Triton program per row.

vLLM 0.26 runs Command-R / Cohere's LayerNorm as torch ops in float32 (mean, centred variance, rsqrt, weight),
wrapped in `torch.compile`: the row reductions become Inductor's reduction kernel, whose block and split over a
row follow the tensor's row count (and, eager, torch's generic reduction does the same). A decode step (a few
rows) and a prefill or the training forward (many rows) then sum a row in different orders: C3 and C5 fail on a
few tokens. This patch computes the same formula, (x - mean) * rsqrt(var + eps) * w in float32 rounded once, with
one program per row over a block fixed by the row length, so no row count enters. The training side on vLLM's
kernels calls `commandr.layer_norm_func` itself (tic.harness.kernels.vllm_provider), so it runs this kernel too
when the patch is active. CPU calls keep vLLM's function.
"""

# no `from __future__ import annotations`: torch.library reads the custom op's annotations as types
import functools

from tic.patches._swap import swap_hooks
from tic.patches.base import Patch
from tic.patches.vllm._triton_options import PINNED

NAME = "layernorm-float32-rows"
HOME = "vllm.model_executor.models.commandr"


@functools.cache
def _kernel():
    """Compiled on first use (tic imports this module on machines without Triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _layer_norm_rows(x_ptr, w_ptr, y_ptr, H, sx, sy, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        x = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / H
        centred = tl.where(mask, x - mean, 0.0)
        var = tl.sum(centred * centred, axis=0) / H
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = w * (centred * tl.math.rsqrt(var + eps))
        tl.store(y_ptr + row * sy + cols, y.to(y_ptr.dtype.element_ty), mask=mask)

    return _layer_norm_rows


def layer_norm_float32_rows(x, weight, epsilon: float):
    """commandr's layer_norm_func on CUDA rows: x's shape and dtype, the last dimension normalised."""
    import torch

    from tic.patches.vllm.rowwise_rmsnorm import row_launch, rows_2d

    h = x.shape[-1]
    x2 = rows_2d(x)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block, warps = row_launch(h)
        _kernel()[(x2.shape[0],)](x2, weight.contiguous(), y, h, x2.stride(0), y.stride(0), epsilon, BLOCK=block,
                                  num_warps=warps, **PINNED)
    return y.view(x.shape)


@functools.cache
def _op():
    """A torch custom op, so that vLLM's torch.compile sees one opaque call."""
    import torch

    @torch.library.custom_op("tic::layer_norm_float32_rows", mutates_args=())
    def rows(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
        return layer_norm_float32_rows(x, weight, epsilon)

    @rows.register_fake
    def _(x, weight, epsilon):
        return torch.empty_like(x)

    return rows


def _rows_on_cuda(original):
    def layer_norm_func(hidden_states, weight, variance_epsilon):
        if not hidden_states.is_cuda:
            return original(hidden_states, weight, variance_epsilon)
        return _op()(hidden_states, weight, float(variance_epsilon))
    return layer_norm_func


PATCH = Patch(
    name=NAME, target="vllm", versions=">=0.26.0,<0.27", gate="C3",
    symptom="C3 or C5 fails by a few tokens in a Cohere / Command-R LayerNorm (input_layernorm or the final norm, "
            "a float32 mean and variance in torch ops): vLLM's compiled layer_norm_func reduces a row in an order "
            "that follows the launch's row count",
    fix="commandr.layer_norm_func on CUDA runs a Triton kernel of one program per row (the same float32 formula, "
        "reduction order fixed by the row length); the training side on vLLM's kernels calls the same function",
    guide="guides/ops/norm-block-shape.md",
    cost="not measured: one Triton launch in place of Inductor's reduction kernel",
    **swap_hooks(NAME, (HOME, "layer_norm_func", _rows_on_cuda, HOME)),
)
