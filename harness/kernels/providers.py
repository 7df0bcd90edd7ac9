"""The kernel providers by the name tic.yaml gives them (`kernels: consistent` | `kernels: vllm`).

The providers (spec.py says what one is) depend on the spec, not on each other or on this registry; vLLM itself is
imported only when its provider is built, never at tic import.
"""

from __future__ import annotations

from tic.harness.kernels.consistent_cpu import CPUProvider
from tic.harness.kernels.spec import DEFAULT_KV_BLOCK_SIZE, KernelProvider
from tic.harness.kernels.vllm_provider import VLLMProvider


def provider_for(kernels: str, kv_block_size: int = DEFAULT_KV_BLOCK_SIZE, kv_cache_dtype: str = "auto") -> KernelProvider:
    """A provider for `kernels: consistent` (cpu) or `kernels: vllm`, whose attention reads K/V as a cache of
    kv_cache_dtype does (fp8: rounded to e4m3), the vLLM one paged in kv_block_size slots (the vLLM rollout's page
    size; the CPU kernels have no pages). One per wrapped model."""
    if kernels == "consistent":
        return CPUProvider(kv_cache_dtype)
    if kernels == "vllm":
        return VLLMProvider(kv_block_size, kv_cache_dtype)
    raise ValueError(f"no kernel provider for kernels {kernels!r}")
