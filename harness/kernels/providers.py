"""The kernel providers by the name tic.yaml gives them (`kernels: consistent` | `kernels: vllm`).

The providers (spec.py says what one is) depend on the spec, not on each other or on this registry; vLLM itself is
imported only when its provider is built, never at tic import.
"""

from __future__ import annotations

from tic.harness.kernels.consistent_cpu import CPUProvider
from tic.harness.kernels.spec import DEFAULT_KV_BLOCK_SIZE, KernelProvider
from tic.harness.kernels.vllm_provider import VLLMProvider


def provider_for(kernels: str, kv_block_size: int = DEFAULT_KV_BLOCK_SIZE, kv_cache_dtype: str = "auto") -> KernelProvider:
    """A provider for `kernels: consistent` (cpu) or `kernels: vllm`, whose prefill attention pages K/V in
    kv_block_size slots of kv_cache_dtype (the vLLM rollout's page size and cache dtype; the CPU kernels have no
    pages). One per wrapped model."""
    if kernels == "consistent":
        return CPUProvider()
    if kernels == "vllm":
        return VLLMProvider(kv_block_size, kv_cache_dtype)
    raise ValueError(f"no kernel provider for kernels {kernels!r}")
