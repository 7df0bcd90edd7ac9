"""Dense (unquantized) linear layers through one fixed-K-order GEMM for every batch size, in one launch.

cuBLAS picks its kernel, tile and split-K from the problem shape, so a token's row is summed over K in another
order when its batch has another number of rows (C3 fails in a projection, `aten.linear`). The method's rule for
dense GEMM is one accumulation order for every M (reference 4.1). This patch replaces vLLM's default unquantized
GEMM with tic's Triton GEMM (fixed_order_gemm.py): no split-K, K walked upwards in one MMA chain, so a row's
value does not depend on its batch-mates while the tile, and so the speed, may follow the batch size. It runs
the whole batch in one launch, where gemm-fixed-m ran one cuBLAS call per 128 rows. Where cuBLAS's own kernel
for a problem gives that GEMM's bits (checked per problem on seeded operands in the running process), cuBLAS runs
it: most of its kernels walk K in the same chain, only its split-K choices for few rows do not.
"""

from tic.patches.base import Patch
from tic.patches.vllm._decided import with_eager_run_before_capture
from tic.patches.vllm._gemm_dispatch import dispatch_swap, vllm_gemm

NAME = "gemm-fixed-order"
DTYPES = ("bfloat16", "float16")  # the GEMM's inputs (a float32 tl.dot would round its inputs to TF32)


def linear_fixed_order(x, weight, bias=None):
    """tic's fixed-order GEMM for bf16/fp16; other dtypes run vLLM's own GEMM, unchanged (and C3 says whether
    that is batch-invariant)."""
    if str(x.dtype).removeprefix("torch.") not in DTYPES:
        return vllm_gemm()(None, x, weight, bias)
    from tic.patches.vllm.fixed_order_gemm import linear

    return linear(x, weight, bias)


def _checks() -> dict:
    import sys

    mod = sys.modules.get("tic.patches.vllm.fixed_order_gemm")  # never imported: no GEMM ran, nothing chosen
    return mod.checks() if mod is not None else {}


PATCH = Patch(
    name=NAME, target="vllm", versions=">=0.26.0,<0.27", gate="C3",
    symptom="C3 (or C4) fails in an MLP or attention projection (e.g. mlp.down_proj), first operator aten.linear "
            "/ aten.mm: the same row differs between a GEMM of few rows and one of many",
    fix="every unquantized bf16/fp16 vLLM linear (and the lm_head) gets one K order for every batch size: tic's "
        "Triton GEMM (no split-K, the tile chosen by speed among tiles proven to give the same bits), or cuBLAS "
        "for a problem where a check in the process showed cuBLAS gives those bits",
    guide="guides/C3.md",
    cost="measured per projection against cuBLAS in benchmarks/gpu/gemm_order_probe.py and end to end in "
         "docs/results/rollout-throughput.md",
    excludes=("gemm-fixed-m",),
    **with_eager_run_before_capture(NAME, dispatch_swap(NAME, "tic::linear_fixed_order", linear_fixed_order)),
    _choices=_checks,
)
