"""The kernel providers by the name tic.yaml gives them (`kernels: consistent` | `kernels: vllm`).

The providers (spec.py says what one is) depend on the spec, not on each other or on this registry; vLLM itself is
imported only when its provider is built, never at tic import.
"""

from __future__ import annotations

from tic.harness.kernels.consistent_cpu import CPUProvider
from tic.harness.kernels.spec import KernelProvider, RolloutKernels
from tic.harness.kernels.vllm_provider import VLLMProvider


def provider_for(kernels: str, rollout: RolloutKernels = RolloutKernels(),
                 kv_cache_dtype: str = "auto") -> KernelProvider:
    """A provider for `kernels: consistent` (cpu) or `kernels: vllm`, whose attention reads K/V as a cache of
    kv_cache_dtype does (fp8: rounded to e4m3), the vLLM one built to match the vLLM rollout it recomputes
    (`rollout`: its page size and logprob rule; the CPU kernels have neither). One per wrapped model."""
    if kernels == "consistent":
        return CPUProvider(kv_cache_dtype)
    if kernels == "vllm":
        return VLLMProvider(rollout, kv_cache_dtype)
    raise ValueError(f"no kernel provider for kernels {kernels!r}")
