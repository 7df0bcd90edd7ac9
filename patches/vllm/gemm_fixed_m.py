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
    pad = None
    for s in range(0, n, ROWS):
        e = min(s + ROWS, n)
        tile = x2[s:e]
        if e - s < ROWS or tile.data_ptr() % 16 != 0:
            if pad is None:
                pad = x2.new_zeros((ROWS, k))
            pad[: e - s].copy_(tile)
            if e - s < ROWS:
                pad[e - s:].zero_()
            tile = pad
        out[s:e] = gemm(None, tile, weight, bias)[: e - s]
    return out.view(*x.shape[:-1], weight.shape[0])


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
    op = _register_op()

    def fixed_m_gemm(layer, x, weight, bias=None):
        return op(x, weight, bias)

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
