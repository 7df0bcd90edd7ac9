"""Block-FP8 linears through one GEMM kernel for every batch size.

On Hopper vLLM 0.26 runs a block-FP8 checkpoint's linears with `FlashInferFp8DeepGEMMDynamicBlockScaledKernel`,
which picks its kernel from the batch's row count: FlashInfer's swapAB GEMM below 32 rows (bf16 input, quantized
inside FlashInfer), DeepGEMM from 32 rows on (input quantized per 1 x 128 group by vLLM, then `fp8_gemm_nt`). The
two kernels round differently, so a decode step (few rows) and the prefill or training forward (many rows) that
score the same token disagree. vLLM's batch-invariant mode takes the DeepGEMM branch for every size; this patch
does the same for that one dispatch and nothing else: the module's view of `vllm.envs` answers
VLLM_BATCH_INVARIANT = True and delegates every other setting to the real `vllm.envs`.
"""

from __future__ import annotations

from tic.patches._swap import swap_hooks
from tic.patches.base import Patch

NAME = "fp8-gemm-one-kernel"
_HOME = "vllm.model_executor.kernels.linear.scaled_mm.flashinfer"


class _DeepGemmEveryBatch:
    """vllm.envs as the dynamic FlashInfer/DeepGEMM dispatch reads it: the batch-invariant switch on (its one
    read of envs), everything else vLLM's own setting."""

    def __init__(self, envs):
        self._envs = envs

    VLLM_BATCH_INVARIANT = True

    def __getattr__(self, attr):
        return getattr(self._envs, attr)


PATCH = Patch(
    name=NAME, target="vllm", versions=">=0.26.0,<0.27", gate="C3",
    symptom="C3 (or C4, C5) fails on a block-FP8 model in an attention or MLP projection: decode steps of fewer "
            "than 32 tokens run FlashInfer's FP8 GEMM, larger steps and the training forward DeepGEMM",
    fix="the dynamic FlashInfer/DeepGEMM block-FP8 dispatch takes its DeepGEMM branch (vLLM's batch-invariant "
        "choice) for every row count",
    guide="guides/C3.md",
    cost="decode steps below 32 tokens run DeepGEMM instead of FlashInfer's small-batch kernel; its speed not yet measured",
    **swap_hooks(NAME, (_HOME, "envs", _DeepGemmEveryBatch, _HOME)),
)
