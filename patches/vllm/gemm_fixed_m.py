"""Dense (unquantized) linear layers with one cuBLAS kernel for every batch size: fixed-M row tiles.

cuBLAS picks its GEMM kernel (tile shape, split-K) from the problem shape, so the same token row is reduced
over K in another order when the batch has another number of rows: on the H200 with vLLM 0.26.0 default mode,
C3 (alone vs batch) failed at `mlp.down_proj` (`aten.linear`) on a hidden-2048 model. The method's rule for
dense GEMM is one accumulation order for every M (reference 4.1). This patch keeps cuBLAS and feeds it one
shape: rows are cut into tiles of exactly ROWS rows (the last zero-padded), each tile one GEMM of the same
(M, N, K), so a row's result does not depend on its batch-mates. Decode batches below ROWS pay padded rows,
which cost little while a GEMM that small is bound by reading the weights.
"""

# no `from __future__ import annotations`: torch.library reads the custom ops' annotations as types
from tic.patches._swap import swap_hooks
from tic.patches.base import Patch

NAME = "gemm-fixed-m"
ROWS = 128
_HOME = "vllm.model_executor.layers.utils"
_state: dict = {}


def linear_fixed_m(x, weight, bias=None):
    """vLLM's own unquantized GEMM (the one its dispatcher chose), called only on tiles of exactly ROWS rows."""
    gemm = _state["gemm"]
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    n = x2.shape[0]
    out = x2.new_empty((n, weight.shape[0]))
    full = n // ROWS * ROWS
    if full and bias is None and x2.data_ptr() % 16 == 0 and _mm_is_gemm(gemm, x2, weight):
        # full tiles written in place: one mm per tile into its rows of `out` (no per-tile output and copy; in
        # training, 32 tiles per 4096 tokens, the loop's launches are what this patch costs)
        wt = weight.t()
        for tile, rows in zip(x2[:full].split(ROWS), out[:full].split(ROWS)):
            _state["mm"](tile, wt, out=rows)
        start = full
    else:
        start = 0
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


def _mm_is_gemm(gemm, x2, weight) -> bool:
    """Whether mm(tile, w.t()) gives vLLM's GEMM's bits on a (ROWS, K) x (K, N) tile of these dtypes and device
    (vLLM 0.26's default GEMM is F.linear, which without a bias is that mm; another dispatch may differ). Decided
    once per problem on seeded random operands, never on the data, so every process (rollout and training)
    decides alike; while a CUDA graph is being captured an unseen problem takes the copying path."""
    import torch

    key = (tuple(weight.shape), weight.dtype, x2.dtype, str(x2.device), weight.stride())
    seen = _state.setdefault("mm_is_gemm", {})
    if key not in seen:
        if x2.is_cuda and torch.cuda.is_current_stream_capturing():
            return False
        g = torch.Generator().manual_seed(0)
        a = torch.randn(ROWS, x2.shape[1], generator=g).to(x2.dtype).to(x2.device)
        w = torch.empty_strided(weight.shape, weight.stride(), dtype=weight.dtype, device=weight.device)
        w.copy_(torch.randn(weight.shape, generator=g))  # the weight's own layout: it picks the kernel too
        got = torch.empty(ROWS, w.shape[0], dtype=x2.dtype, device=x2.device)
        torch.mm(a, w.t(), out=got)
        seen[key] = bool(torch.equal(got, gemm(None, a, w, None)))
        _state.setdefault("mm", torch.mm)
    return seen[key]


def _register_op():
    if "op" in _state:
        return _state["op"]
    import typing

    import torch

    @torch.library.custom_op("tic::linear_fixed_m", mutates_args=())
    def op(x: torch.Tensor, weight: torch.Tensor, bias: typing.Optional[torch.Tensor]) -> torch.Tensor:
        return linear_fixed_m(x, weight, bias)

    @op.register_fake
    def _(x, weight, bias):
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    _state["op"] = op
    return op


def _make(original_dispatch):
    import torch

    op = _register_op()

    def fixed_m_gemm(layer, x, weight, bias=None):
        # the custom op is what torch.compile (vLLM's graph mode) sees; eager calls skip its dispatch, which on
        # the H200 cost more host time per call than the tile loop itself
        if torch.compiler.is_compiling():
            return op(x, weight, bias)
        return linear_fixed_m(x, weight, bias)

    def dispatch():
        chosen = original_dispatch()
        if chosen.__name__ != "default_unquantized_gemm":  # ROCm / CPU GEMMs take other paths: untouched
            return chosen
        _state["gemm"] = chosen
        return fixed_m_gemm
    return dispatch


PATCH = Patch(
    name=NAME, target="vllm", versions=">=0.26.0,<0.27", gate="C3",
    symptom="C3 (or C4) fails in an MLP or attention projection (e.g. mlp.down_proj), first operator aten.linear "
            "/ aten.mm: the same row differs between a GEMM of few rows and one of many",
    fix=f"every unquantized vLLM linear (and the lm_head) runs as GEMMs of exactly {ROWS} rows (the last tile "
        "zero-padded): one cuBLAS kernel, one K order, whatever the batch",
    guide="guides/C3.md",
    cost="prefill runs one GEMM per 128 rows instead of one per batch; decode below 128 rows pads; the three "
         "patches together ran at 118-119 % of default (docs/results/vllm-patches.md)",
    **swap_hooks(NAME, (_HOME, "dispatch_unquantized_gemm", _make, "vllm.")),
)
