"""The hook the dense-GEMM patches share: vLLM's unquantized GEMM dispatch, swapped for one that hands out tic's GEMM.

vLLM's linear layers ask `dispatch_unquantized_gemm()` for their GEMM; the swapped dispatch returns tic's in place
of vLLM's default (F.linear), and leaves other platforms' GEMMs (ROCm, CPU) alone. Inside torch.compile (vLLM's
graph mode) tic's GEMM is a custom op, so Inductor keeps it as one opaque call instead of choosing a GEMM itself.
"""

# no `from __future__ import annotations`: torch.library reads the custom op's annotations as types
from tic.patches._swap import swap_hooks

HOME = "vllm.model_executor.layers.utils"
ATTR = "dispatch_unquantized_gemm"
_ops: dict = {}
_vllm: dict = {}  # "gemm": vLLM's own default GEMM, recorded when a swapped dispatch hands out tic's


def vllm_gemm():
    """The GEMM vLLM's own dispatcher picks (unpatched). Recorded when the patched dispatcher runs; looked up again
    when it never ran in this process: a graph vLLM compiled earlier and loaded from its compile cache calls the
    custom op without tracing the Python that dispatches."""
    if "gemm" not in _vllm:
        import importlib

        dispatch = getattr(importlib.import_module(HOME), ATTR)
        _vllm["gemm"] = getattr(dispatch, "__wrapped__", dispatch)()
    return _vllm["gemm"]


def _custom_op(qualname: str, linear):
    if qualname in _ops:
        return _ops[qualname]
    import typing

    import torch

    @torch.library.custom_op(qualname, mutates_args=())
    def op(x: torch.Tensor, weight: torch.Tensor, bias: typing.Optional[torch.Tensor]) -> torch.Tensor:
        return linear(x, weight, bias)

    @op.register_fake
    def _(x, weight, bias):
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    _ops[qualname] = op
    return op


def dispatch_swap(name: str, qualname: str, linear) -> dict:
    """A Patch's apply/revert/is_applied that makes vLLM's default unquantized GEMM `linear(x, weight, bias)`
    (registered as the custom op `qualname`); vllm_gemm() gives the GEMM it replaces."""
    def make(original_dispatch):
        import torch

        op = _custom_op(qualname, linear)

        from torch.utils._python_dispatch import _get_current_dispatch_mode

        def tic_gemm(layer, x, weight, bias=None):
            # one opaque op inside torch.compile, and under a dispatch mode (tic's operator recorder, fake
            # tensors): a recorder then sees one GEMM call whatever kernel and tile it launches for this M, so
            # the two sides of a comparison pair up. Plain eager calls skip the op's dispatch (host time).
            if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
                return op(x, weight, bias)
            return linear(x, weight, bias)

        def dispatch():
            chosen = original_dispatch()
            if chosen.__name__ != "default_unquantized_gemm":
                return chosen
            _vllm["gemm"] = chosen
            return tic_gemm
        return dispatch

    return swap_hooks(name, (HOME, ATTR, make, "vllm."))
