"""vLLM's RMSNorm and fused add+RMSNorm through tic's Triton row kernel, for every row count (no padded launches).

The same flaw as rmsnorm-fixed-block's (vLLM 0.26's CUDA launchers pick a row's block shape from the number of
rows in the launch, so decode and prefill round a row differently), fixed the other way: instead of padding small
launches to the large launch's 256 rows (two copies in and two out per fused call, plus a kernel over 256 rows),
every call goes to `rowwise_rmsnorm.rms_norm_rows`, whose reduction depends on the row length alone. On CUDA both
vLLM's CUDA entries (`vllm_c`) and its native PyTorch code go there; elsewhere vLLM's own code runs.

The values are the norm's (x in float32, plus the residual rounded to the input dtype, x * rsqrt(mean(x^2) + eps)
rounded to the weight's dtype and times the weight), but not the CUDA kernel's bits: its block reduction sums in
another order. So the training forward must run the same kernel, and it does (the `kernels: vllm` provider calls
these implementations). Exclusive with rmsnorm-fixed-block, which changes the same entries.
"""

# no `from __future__ import annotations`: torch.library reads the custom ops' annotations as types
import functools

from tic.patches._swap import swap_everywhere
from tic.patches.base import Patch
from tic.patches.vllm.rmsnorm_fixed_block import PATCH as FIXED_BLOCK
from tic.patches.vllm.rmsnorm_fixed_block import (_OPS, _ir_impls, _register_ops, norm_entries_applied,
                                                  revert_norm_entries, wrap_ir_impls)

NAME = "rmsnorm-rows"


def on_row_kernel(x) -> bool:
    """Where the Triton row kernel runs (CUDA tensors); elsewhere vLLM's own code."""
    return x.is_cuda


def _apply() -> None:
    _, _, rows_op, fused_rows_op = _register_ops()

    def rms_entry(original):  # vllm._custom_ops.rms_norm(out, input, weight, epsilon)
        def entry(out, input, weight, epsilon):
            if not on_row_kernel(input):
                return original(out, input, weight, epsilon)
            out.copy_(rows_op(input, weight, epsilon).view(out.shape))
        return entry

    def fused_entry(original):  # vllm._custom_ops.fused_add_rms_norm(input, residual, weight, epsilon), in place
        def entry(input, residual, weight, epsilon):
            if not on_row_kernel(input):
                return original(input, residual, weight, epsilon)
            y, r = fused_rows_op(input, residual, weight, epsilon)
            input.copy_(y)
            residual.copy_(r)
        return entry

    swap_everywhere(_OPS, "rms_norm", rms_entry, NAME, _OPS)
    swap_everywhere(_OPS, "fused_add_rms_norm", fused_entry, NAME, _OPS)

    # vLLM's model code reaches the norm through its IR ops (also while its compiler traces them: the call is the
    # opaque custom op); their callers take the returned tensors, as from the native implementation
    def rms_ir(original):
        def ir_entry(x, weight, epsilon, variance_size=None):
            if variance_size is not None or not on_row_kernel(x):
                return original(x, weight, epsilon, variance_size)
            return rows_op(x, weight, epsilon)
        return ir_entry

    def fused_ir(original):
        def ir_entry(x, x_residual, weight, epsilon, variance_size=None):
            if variance_size is not None or not on_row_kernel(x):
                return original(x, x_residual, weight, epsilon, variance_size)
            return fused_rows_op(x, x_residual, weight, epsilon)
        return ir_entry

    wrap_ir_impls([(impl, make) for provider in ("vllm_c", "native")
                   for impl, make in zip(_ir_impls(provider), (rms_ir, fused_ir))], NAME)


PATCH = Patch(
    name=NAME, target="vllm", versions=">=0.26.0,<0.27", gate="C4",
    symptom=FIXED_BLOCK.symptom,
    fix="every RMSNorm and fused add+RMSNorm on CUDA runs a Triton kernel whose launch and reduction order follow "
        "the row length alone (strided rows read in place, no padded launches); the training forward runs the same "
        "kernel",
    guide="guides/ops/norm-block-shape.md",
    cost="faster than rmsnorm-fixed-block: with it the consistent rollout in vLLM's default compilation mode ran at "
         "0.952 of default vLLM on Qwen3-8B's long decode (0.911 with rmsnorm-fixed-block) and 0.956-0.964 on "
         "Qwen3-30B-A3B (H100, docs/results/rollout-throughput.md)",
    excludes=("rmsnorm-fixed-block",),
    _apply=_apply, _revert=functools.partial(revert_norm_entries, NAME),
    _is_applied=functools.partial(norm_entries_applied, NAME),
)
