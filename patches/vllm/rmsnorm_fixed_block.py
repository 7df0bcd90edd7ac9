"""vLLM's RMSNorm CUDA kernels (`_C.rms_norm` and `_C.fused_add_rms_norm`) launched with one block shape and one
code path for every token count.

Both launchers of vLLM 0.26 give each token row one thread block whose size depends on how many rows share the
launch: at most 1024 threads below 256 rows, at most 256 from 256 rows on (`rms_norm` in bf16: min(hidden / 8,
that bound) threads, so the two differ once hidden > 2048; the fused kernel also changes its code path with
pointer alignment). Each thread sums its own slice of the row before the block reduction, so the per-thread
slices, hence the float32 sum of squares, change with the block shape, and a row's result depends on how many
rows share its launch: decode steps (few rows) and prefill or a training forward (many) disagree. Measured on the
H200 (docs/results/shape-sweep.md): 48-row launches against one 4096-row launch differ in 1-2 % of bf16 rows
for both kernels at hidden 2560-8192, none at 2048.

This patch keeps the CUDA kernels and always launches them the way a large batch does: at least 256 rows (a
small batch is copied into a padded buffer) in aligned, contiguous buffers, so every row sees 256 threads and the
same path. Launches of 256 rows or more already have that shape and go to the kernel unchanged. Each row is its own
thread block and nothing crosses rows, so the padding rows are left unwritten: a fill per launch cost about 2 % of
a decode step (docs/results/rollout-throughput.md).

Where vLLM's CUDA kernel refuses the arguments (a weight of another dtype than the rows: Gemma's float32 (1 + w)),
vLLM runs its IR op's native PyTorch code, whose reduction also splits rows by the tensor's shape. On CUDA the
patch gives those calls tic's Triton row kernel (rowwise_rmsnorm.py), the same arithmetic in a reduction order
fixed by the row length.
"""

# no `from __future__ import annotations`: torch.library reads the custom ops' annotations as types
import functools

from tic.patches._swap import is_swapped, restore_everywhere, swap_everywhere
from tic.patches.base import Patch

NAME = "rmsnorm-fixed-block"
MIN_ROWS = 256  # the launchers' large-batch block bound (256 threads) for every token count
_state: dict = {}


def _aligned(t) -> bool:
    return t is None or t.data_ptr() % 16 == 0


def _aligned_weight(weight):
    return weight if _aligned(weight) else weight.clone()


def rms_norm_fixed_block(out, x, weight, epsilon: float) -> None:
    """Like `_C.rms_norm(out, x, weight, epsilon)`: out <- rmsnorm(x) * weight, launched with >= MIN_ROWS rows."""
    import torch

    h = x.shape[-1]
    n = x.numel() // h
    if n >= MIN_ROWS:
        torch.ops._C.rms_norm(out, x, weight, epsilon)
        return
    bx = x.new_empty((MIN_ROWS, h))
    bx[:n].copy_(x.reshape(n, h))
    bo = torch.empty_like(bx)
    torch.ops._C.rms_norm(bo, bx, _aligned_weight(weight), epsilon)
    out.copy_(bo[:n].view(out.shape))


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
    bx = x.new_empty((rows, h))
    br = residual.new_empty((rows, h))
    bx[:n].copy_(x.reshape(n, h))
    br[:n].copy_(residual.reshape(n, h))
    torch.ops._C.fused_add_rms_norm(bx, br, _aligned_weight(weight), epsilon)
    x.copy_(bx[:n].view(x.shape))
    residual.copy_(br[:n].view(residual.shape))


def _register_ops():
    """Torch custom ops, so torch.compile and CUDA graphs see one opaque call each, not the Python around it."""
    if "ops" in _state:
        return _state["ops"]
    import typing

    import torch

    @torch.library.custom_op("tic::rms_norm_fixed_block", mutates_args=("out",))
    def rms(out: torch.Tensor, x: torch.Tensor, weight: typing.Optional[torch.Tensor], epsilon: float) -> None:
        rms_norm_fixed_block(out, x, weight, epsilon)

    @rms.register_fake
    def _(out, x, weight, epsilon):
        return None

    @torch.library.custom_op("tic::fused_add_rms_norm_fixed_block", mutates_args=("x", "residual"))
    def fused(x: torch.Tensor, residual: torch.Tensor, weight: typing.Optional[torch.Tensor], epsilon: float) -> None:
        fused_add_rms_norm_fixed_block(x, residual, weight, epsilon)

    @fused.register_fake
    def _(x, residual, weight, epsilon):
        return None

    @torch.library.custom_op("tic::rms_norm_rows", mutates_args=())
    def rows(x: torch.Tensor, weight: typing.Optional[torch.Tensor], epsilon: float) -> torch.Tensor:
        from tic.patches.vllm.rowwise_rmsnorm import rms_norm_rows

        return rms_norm_rows(x, weight, epsilon)

    @rows.register_fake
    def _(x, weight, epsilon):
        return torch.empty_like(x)

    @torch.library.custom_op("tic::fused_add_rms_norm_rows", mutates_args=())
    def fused_rows(x: torch.Tensor, residual: torch.Tensor, weight: typing.Optional[torch.Tensor],
                   epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
        from tic.patches.vllm.rowwise_rmsnorm import rms_norm_rows

        return rms_norm_rows(x, weight, epsilon, residual)

    @fused_rows.register_fake
    def _(x, residual, weight, epsilon):
        return torch.empty_like(x), torch.empty_like(x)

    _state["ops"] = (rms, fused, rows, fused_rows)
    return _state["ops"]


def _eager_entry(op, python_fn):
    """For callers outside vLLM's model code (vllm._custom_ops: the training provider, batch-invariant mode): the
    Python function in eager, which skips the custom op's dispatch; the op while torch.compile traces."""
    def call(*args):
        import torch

        if torch.compiler.is_compiling():
            return op(*args)
        return python_fn(*args)
    return call


def _ir_impls(provider: str = "vllm_c"):
    from vllm import ir
    import vllm.kernels.vllm_c  # noqa: F401  (registers the vllm_c implementations)

    return ir.ops.rms_norm.impls[provider], ir.ops.fused_add_rms_norm.impls[provider]


def _all_ir_impls():
    return (*_ir_impls("vllm_c"), *_ir_impls("native"))


_OPS = "vllm._custom_ops"  # batch-invariant mode and other callers reach the kernels through these


def _apply() -> None:
    rms_op, fused_op, rows_op, fused_rows_op = _register_ops()
    rms_call = _eager_entry(rms_op, rms_norm_fixed_block)
    fused_call = _eager_entry(fused_op, fused_add_rms_norm_fixed_block)

    def rms_entry(out, input, weight, epsilon):  # vllm._custom_ops.rms_norm
        rms_call(out, input, weight, epsilon)

    def fused_entry(input, residual, weight, epsilon):  # vllm._custom_ops.fused_add_rms_norm
        fused_call(input, residual, weight, epsilon)

    swap_everywhere(_OPS, "rms_norm", lambda original: rms_entry, NAME, _OPS)
    swap_everywhere(_OPS, "fused_add_rms_norm", lambda original: fused_entry, NAME, _OPS)
    rms_impl, fused_impl = _ir_impls()

    # vLLM's model code reaches the kernels through its IR ops, also while its compiler traces or lowers them:
    # there the call is always the opaque custom op (the Python around the kernel branches on the row count)
    def rms_ir(original):
        def ir_entry(x, weight, epsilon, variance_size=None):  # vllm_ir.rms_norm (vllm_c)
            if variance_size is not None:
                return original(x, weight, epsilon, variance_size)
            import torch

            out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
            rms_op(out, x, weight, epsilon)
            return out
        return ir_entry

    def fused_ir(original):
        def ir_entry(x, x_residual, weight, epsilon, variance_size=None):  # vllm_ir.fused_add_rms_norm (vllm_c)
            if variance_size is not None:
                return original(x, x_residual, weight, epsilon, variance_size)
            fused_op(x, x_residual, weight, epsilon)
            return x, x_residual
        return ir_entry

    # the native implementations (what vLLM runs where its CUDA kernel refuses the arguments, e.g. Gemma's float32
    # (1 + w) weight) get a row kernel of fixed reduction order on CUDA
    def rms_native(original):
        def native_entry(x, weight, epsilon, variance_size=None):  # vllm_ir.rms_norm (native)
            if variance_size is not None or not x.is_cuda:
                return original(x, weight, epsilon, variance_size)
            return rows_op(x, weight, epsilon)
        return native_entry

    def fused_native(original):
        def native_entry(x, x_residual, weight, epsilon, variance_size=None):  # vllm_ir.fused_add_rms_norm
            if variance_size is not None or not x.is_cuda:
                return original(x, x_residual, weight, epsilon, variance_size)
            return fused_rows_op(x, x_residual, weight, epsilon)
        return native_entry

    rms_native_impl, fused_native_impl = _ir_impls("native")
    wrap_ir_impls(((rms_impl, rms_ir), (fused_impl, fused_ir), (rms_native_impl, rms_native),
                   (fused_native_impl, fused_native)), NAME)


def wrap_ir_impls(pairs, name: str) -> None:
    """Each (IR implementation, make(original) -> entry): its impl_fn replaced by the entry, marked as patch
    `name`'s and holding the original (once)."""
    for impl, make in pairs:
        if getattr(impl.impl_fn, "__tic_patch__", None) != name:
            entry = make(impl.impl_fn)
            entry.__tic_patch__ = name
            entry.__wrapped__ = impl.impl_fn
            impl.impl_fn = entry


def revert_norm_entries(name: str) -> None:
    """Patch `name`'s norm entries back to vLLM's: vllm._custom_ops and both IR implementations of both norms."""
    for attr in ("rms_norm", "fused_add_rms_norm"):
        restore_everywhere(_OPS, attr, name, _OPS)
    for impl in _all_ir_impls():
        if getattr(impl.impl_fn, "__tic_patch__", None) == name:
            impl.impl_fn = impl.impl_fn.__wrapped__


def norm_entries_applied(name: str) -> bool:
    try:
        impls = _all_ir_impls()
    except (ImportError, KeyError, AttributeError):
        return False
    return (all(is_swapped(_OPS, attr, name) for attr in ("rms_norm", "fused_add_rms_norm"))
            and all(getattr(impl.impl_fn, "__tic_patch__", None) == name for impl in impls))


PATCH = Patch(
    name=NAME, target="vllm", versions=">=0.26.0,<0.27", gate="C4",
    symptom="C4 (or C3, C5) fails in a layer's input_layernorm / post_attention_layernorm (or the final norm), "
            "operator _C.rms_norm or _C.fused_add_rms_norm (or aten.mean under vLLM's native norm, e.g. Gemma's): "
            "the same row differs between a launch of few rows "
            "(decode) and one of many (prefill, the training forward)",
    fix="every RMSNorm and fused add+RMSNorm launch gets >= 256 rows (small batches padded) and 16-byte-"
        "aligned contiguous buffers: one block shape (256 threads) and one code path for every token count; the "
        "native norm vLLM runs for other weight dtypes (Gemma's 1 + w) runs a row kernel of fixed order",
    guide="guides/C4.md",
    cost="steps below 256 tokens copy their rows into a padded buffer (small copies per norm); larger steps "
         "unchanged; the three patches together ran at 118-119 % of default before the plain-RMSNorm half was "
         "added (docs/results/vllm-patches.md); not yet measured with it",
    _apply=_apply, _revert=functools.partial(revert_norm_entries, NAME),
    _is_applied=functools.partial(norm_entries_applied, NAME),
)
