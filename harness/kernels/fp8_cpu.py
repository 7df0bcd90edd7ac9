"""Block-FP8 arithmetic on CPU, row-invariant: what `kernels: consistent` runs for an FP8 model on both sides.

Activations are quantized per token and group of block_k columns as vLLM's `per_token_group_quant_fp8` does
(float32; scale = max(max |x|, eps) / 448 with eps 1e-10; codes = float8_e4m3fn(clamp(x / scale, +-448))). The
GEMM follows vLLM's Triton `w8a8_triton_block_scaled_mm`: for each K block in order, the float32 dot of the codes
times the activation's group scale times the weight tile's scale is added to a float32 accumulator, which is
rounded to the output dtype once at the end; a bias is added after, in the output dtype (W8A8BlockFp8LinearOp).
Each token row's dots run as one call of the same shape whatever the batch, so a row's result does not depend
on the rows beside it.
"""

from __future__ import annotations

import torch

from tic.harness.model.quantize import FP8_MAX, ceil_to_ue8m0

GROUP_EPS = 1e-10  # vLLM's per_token_group_quant_fp8 default: an all-zero group gets scale eps / 448


def per_token_group_quant(x: torch.Tensor, group: int, eps: float = GROUP_EPS,
                          ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [.., K] float8_e4m3fn, scales [.., K / group] float32) of x [.., K]; K must be a multiple of group.
    ue8m0: each scale rounded up to a power of two (vLLM's quantizer where its DeepGEMM path takes UE8M0)."""
    K = x.shape[-1]
    if K % group:
        raise ValueError(f"per-token-group quantization: {K} columns are not a multiple of the group {group}")
    g = x.float().reshape(*x.shape[:-1], K // group, group)
    scale = g.abs().amax(-1).clamp(min=eps) / FP8_MAX
    if ue8m0:
        scale = ceil_to_ue8m0(scale)
    codes = (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.reshape(x.shape), scale


def block_fp8_matmul(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                     block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    """xq [M, K] codes with scales xs [M, K/bk], wq [N, K] codes with tile scales ws [ceil(N/bn), K/bk] -> [M, N].
    Per row: the K blocks' float32 dots as one batched call ([K/bk, 1, bk] x [K/bk, bk, N]); then, in K-block
    order, acc += dot * x_scale * w_scale (elementwise, the same for every row)."""
    bn, bk = block
    M, K = xq.shape
    N = wq.shape[0]
    nk = K // bk
    w_blocks = wq.float().reshape(N, nk, bk).permute(1, 2, 0).contiguous()  # [nk, bk, N]
    w_scale = ws.float().repeat_interleave(bn, dim=0)[:N].t().contiguous()  # [nk, N]
    x_blocks = xq.float().reshape(M, nk, 1, bk)
    dots = torch.stack([torch.bmm(x_blocks[m], w_blocks)[:, 0] for m in range(M)]) if M else \
        xq.new_zeros(0, nk, N, dtype=torch.float32)  # [M, nk, N]
    acc = torch.zeros(M, N, dtype=torch.float32)
    for k in range(nk):
        acc = acc + dots[:, k] * xs[:, k:k + 1] * w_scale[k]
    return acc.to(out_dtype)


def fp8_linear(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor | None,
               block: tuple[int, int]) -> torch.Tensor:
    """x [.., K] in the model dtype through dynamic activation quantization and the block-FP8 GEMM -> [.., N]."""
    flat = x.reshape(-1, x.shape[-1])
    xq, xs = per_token_group_quant(flat, block[1])
    out = block_fp8_matmul(xq, xs, wq, ws, block, x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], wq.shape[0])


def e4m3_round(t: torch.Tensor) -> torch.Tensor:
    """t rounded to float8_e4m3fn and back in t's dtype, saturating at the largest finite value (vLLM's FP8 cache
    and query quantizers with scale 1)."""
    return t.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(t.dtype)


P_SCALE = 2.0 ** 8  # FlashAttention's FP8 forward: exp(s - max) times 2**8 before P is rounded to e4m3
