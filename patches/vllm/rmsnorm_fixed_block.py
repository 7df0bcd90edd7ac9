"""vLLM's fused residual-add RMSNorm CUDA kernel launched with one block shape and one code path for every
token count.

The launcher of `_C.fused_add_rms_norm` (vLLM 0.26) gives each token row one thread block of
min(hidden, 1024 if tokens < 256 else 256) threads, and takes a width-8 vectorized kernel only when the three
pointers are 16-byte aligned and hidden and the row stride are multiples of 8. Each thread sums its own slice
of the row before the block reduction, so the per-thread slices, hence the float32 sum of squares, change
when the block shape changes (hidden / 8 > 256 on the vectorized path: hidden > 2048; any hidden > 256 on the
scalar path) or when the path changes (alignment). A row's result then depends on how many rows share its
launch: decode steps (few rows) and prefill (many) disagree. This patch keeps the CUDA kernel and always
launches it the way a large batch does: at least 256 rows (a small batch is copied into a zero-padded buffer)
and aligned, contiguous buffers, so every row sees 256 threads and the same path.
"""

# no `from __future__ import annotations`: torch.library reads the custom ops' annotations as types
from tic.patches._swap import is_swapped, restore_everywhere, swap_everywhere
from tic.patches.base import Patch

NAME = "rmsnorm-fixed-block"
MIN_ROWS = 256  # the launcher's large-batch block shape (256 threads) for every token count
_state: dict = {}


def _aligned(t) -> bool:
    return t is None or t.data_ptr() % 16 == 0


def fused_add_rms_norm_fixed_block(x, residual, weight, epsilon: float) -> None:
    """In place like `_C.fused_add_rms_norm`: residual <- x + residual, x <- rmsnorm(residual) * weight."""
    import torch

    h = x.shape[-1]
    n = x.numel() // h
    direct = (n >= MIN_ROWS and h % 8 == 0 and x.stride(-1) == 1 and x.stride(-2) % 8 == 0
              and residual.is_contiguous() and _aligned(x) and _aligned(residual) and _aligned(weight))
    if direct:
        torch.ops._C.fused_add_rms_norm(x, residual, weight, epsilon)
        return
    rows = max(n, MIN_ROWS)
    bx = x.new_zeros((rows, h))
    br = residual.new_zeros((rows, h))
    bx[:n].copy_(x.reshape(n, h))
    br[:n].copy_(residual.reshape(n, h))
    w = weight if _aligned(weight) else weight.clone()
    torch.ops._C.fused_add_rms_norm(bx, br, w, epsilon)
    x.copy_(bx[:n].view(x.shape))
    residual.copy_(br[:n].view(residual.shape))


def _register_op():
    """A torch custom op, so torch.compile and CUDA graphs see one opaque call, not the Python around it."""
    if "op" in _state:
        return _state["op"]
    import typing

    import torch

    @torch.library.custom_op("tic::fused_add_rms_norm_fixed_block", mutates_args=("x", "residual"))
    def op(x: torch.Tensor, residual: torch.Tensor, weight: typing.Optional[torch.Tensor], epsilon: float) -> None:
        fused_add_rms_norm_fixed_block(x, residual, weight, epsilon)

    @op.register_fake
    def _(x, residual, weight, epsilon):
        return None

    _state["op"] = op
    return op


def _ir_impl():
    from vllm import ir
    import vllm.kernels.vllm_c  # noqa: F401  (registers the vllm_c implementation)

    return ir.ops.fused_add_rms_norm.impls["vllm_c"]


_OPS = "vllm._custom_ops"  # batch-invariant mode calls its fused_add_rms_norm


def _apply() -> None:
    op = _register_op()

    def make(original):
        def custom_ops_entry(input, residual, weight, epsilon):
            op(input, residual, weight, epsilon)
        return custom_ops_entry

    swap_everywhere(_OPS, "fused_add_rms_norm", make, NAME, _OPS)
    impl = _ir_impl()
    if getattr(impl.impl_fn, "__tic_patch__", None) != NAME:
        original_ir = impl.impl_fn

        def ir_entry(x, x_residual, weight, epsilon, variance_size=None):  # vllm_ir.fused_add_rms_norm
            if variance_size is not None:
                return original_ir(x, x_residual, weight, epsilon, variance_size)
            op(x, x_residual, weight, epsilon)
            return x, x_residual

        ir_entry.__tic_patch__ = NAME
        ir_entry.__wrapped__ = original_ir
        impl.impl_fn = ir_entry


def _revert() -> None:
    restore_everywhere(_OPS, "fused_add_rms_norm", NAME, _OPS)
    impl = _ir_impl()
    if getattr(impl.impl_fn, "__tic_patch__", None) == NAME:
        impl.impl_fn = impl.impl_fn.__wrapped__


def _is_applied() -> bool:
    try:
        impl = _ir_impl()
    except (ImportError, KeyError, AttributeError):
        return False
    return is_swapped(_OPS, "fused_add_rms_norm", NAME) and getattr(impl.impl_fn, "__tic_patch__", None) == NAME


PATCH = Patch(
    name=NAME, target="vllm", versions=">=0.26.0,<0.27", gate="C4",
    symptom="C4 (or C3) fails in a layer's input_layernorm / post_attention_layernorm, first operator "
            "_C.fused_add_rms_norm: the same row differs between a launch of few rows (decode) and many (prefill)",
    fix="every fused add+RMSNorm launch gets >= 256 rows (small batches zero-padded) and 16-byte-aligned "
        "contiguous buffers: one block shape (256 threads) and the vectorized path for every token count",
    guide="guides/C4.md",
    cost="steps below 256 tokens copy their rows into a padded buffer (small copies per norm); larger steps "
         "unchanged; the three patches together ran at 118-119 % of default (docs/results/vllm-patches.md)",
    _apply=_apply, _revert=_revert, _is_applied=_is_applied,
)
