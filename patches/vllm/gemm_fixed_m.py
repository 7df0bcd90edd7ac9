"""Dense (unquantized) linear layers with one cuBLAS kernel for every batch size: fixed-M row tiles.

cuBLAS picks its GEMM kernel (tile shape, split-K) from the problem shape, so the same token row is reduced
over K in another order when the batch has another number of rows: on the H200 with vLLM 0.26.0 default mode,
C3 (alone vs batch) failed at `mlp.down_proj` (`aten.linear`) on a hidden-2048 model. The method's rule for
dense GEMM is one accumulation order for every M (reference 4.1). This patch keeps cuBLAS and feeds it one
shape: rows are cut into tiles of exactly ROWS rows (the last zero-padded), each tile one GEMM of the same
(M, N, K), so a row's result does not depend on its batch-mates. Decode batches below ROWS pay padded rows,
which cost little while a GEMM that small is bound by reading the weights.

Full tiles may run as one strided-batched GEMM (or one in-place mm each) instead of one call of vLLM's GEMM
each, but only for a problem where a probe on seeded random operands found every tile's bits equal to that
tile's own GEMM (on the H200, cuBLAS's batched GEMM gave the same bits for most projection shapes, not for all).
A row's value is the same either way; the launches, which set a training forward's cost, are fewer.
"""

from tic.patches.base import Patch
from tic.patches.vllm._gemm_dispatch import dispatch_swap, vllm_gemm

NAME = "gemm-fixed-m"
ROWS = 128
_state: dict = {}


def linear_fixed_m(x, weight, bias=None):
    """vLLM's own unquantized GEMM (the one its dispatcher chose), called only on tiles of exactly ROWS rows."""
    gemm = vllm_gemm()
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    n = x2.shape[0]
    out = x2.new_empty((n, weight.shape[0]))
    full = n // ROWS * ROWS
    start = 0
    if full and bias is None and x2.is_contiguous() and x2.data_ptr() % 16 == 0:  # the probe's layout
        # the full tiles in one strided-batched GEMM, or one mm per tile written in place, wherever that gives the
        # bits of vLLM's GEMM on each tile alone (probed): in training (32 tiles per 4096 tokens) the per-tile
        # launches, not the arithmetic, are what this patch costs
        tiles = full // ROWS
        for how in (("batched", "per-tile") if tiles > 1 else ("per-tile",)):
            if _same_bits(how, gemm, x2, weight, tiles):
                _full_tiles(how, x2[:full], weight, out[:full], tiles)
                start = full
                break
    pad = None
    for s in range(start, n, ROWS):
        e = min(s + ROWS, n)
        tile = x2[s:e]
        if e - s < ROWS or tile.data_ptr() % 16 != 0:
            if pad is None:
                pad = x2.new_zeros((ROWS, k))
            pad[: e - s].copy_(tile)
            pad[e - s:].zero_()
            tile = pad
        out[s:e] = gemm(None, tile, weight, bias)[: e - s]
    return out.view(*x.shape[:-1], weight.shape[0])


def _full_tiles(how: str, a, weight, out, tiles: int) -> None:
    """out[tile] = a[tile] @ weight.T for `tiles` full tiles: one bmm over [tiles, ROWS, K] (the weight broadcast,
    not copied), or one mm per tile into its rows of out."""
    import torch

    k, n = a.shape[1], weight.shape[0]
    wt = weight.t()
    if how == "batched":
        torch.bmm(a.view(tiles, ROWS, k), wt.expand(tiles, k, n), out=out.view(tiles, ROWS, n))
    else:
        for tile, rows in zip(a.split(ROWS), out.split(ROWS)):
            torch.mm(tile, wt, out=rows)


def _same_bits(how: str, gemm, x2, weight, tiles: int) -> bool:
    """Whether `_full_tiles(how)` gives, on every tile, the bits vLLM's GEMM gives that (ROWS, K) x (K, N) tile alone
    (vLLM 0.26's default GEMM is F.linear, which without a bias is mm(x, w.t()); a batched call or another
    dispatch may pick another kernel). Decided once per problem (and per tile count when batched) on seeded random
    operands made on the device, never on the data, so every process, rollout and training, decides alike. While a
    CUDA graph is being captured an unseen problem takes the per-tile path of vLLM's GEMM."""
    import torch

    key = (how, tiles if how == "batched" else 1, tuple(weight.shape), weight.stride(), weight.dtype, x2.dtype,
           str(x2.device))
    seen = _state.setdefault("same_bits", {})
    if key not in seen:
        if x2.is_cuda and torch.cuda.is_current_stream_capturing():
            return False
        count = key[1]
        g = torch.Generator(device=x2.device).manual_seed(0)
        # in the operands' own dtypes (no float32 copy of a weight-sized tensor); the weight's layout picks kernels
        # too. The weight is drawn in place and each tile's GEMM compared on its own: at most one weight, one output
        # and one tile's output live at once (a 32-tile probe of a 152k-vocab lm_head: 1.2 GB, not 3.7 GB + 2 weights)
        a = torch.randn(count * ROWS, x2.shape[1], generator=g, device=x2.device, dtype=x2.dtype)
        w = torch.empty_strided(weight.shape, weight.stride(), dtype=weight.dtype, device=weight.device)
        w.normal_(generator=g)
        got = torch.empty(count * ROWS, w.shape[0], dtype=x2.dtype, device=x2.device)
        _full_tiles(how, a, w, got, count)
        seen[key] = all(torch.equal(rows, gemm(None, t, w, None)) for t, rows in zip(a.split(ROWS), got.split(ROWS)))
    return seen[key]


PATCH = Patch(
    name=NAME, target="vllm", versions=">=0.26.0,<0.27", gate="C3",
    symptom="C3 (or C4) fails in an MLP or attention projection (e.g. mlp.down_proj), first operator aten.linear "
            "/ aten.mm: the same row differs between a GEMM of few rows and one of many",
    fix=f"every unquantized vLLM linear (and the lm_head) runs as GEMMs of exactly {ROWS} rows (the last tile "
        "zero-padded): one cuBLAS kernel, one K order, whatever the batch",
    guide="guides/C3.md",
    cost="prefill runs one GEMM per 128 rows, re-reading the weights per tile: alone it ran at 0.717 of default "
         "vLLM on the Qwen3-8B shape, 512 -> 256 tokens (docs/results/rollout-throughput.md); gemm-fixed-order "
         "replaces it",
    excludes=("gemm-fixed-order",),
    **dispatch_swap(NAME, "tic::linear_fixed_m", linear_fixed_m),
)
