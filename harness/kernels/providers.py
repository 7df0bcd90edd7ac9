"""The kernel providers by the name tic.yaml gives them (`kernels: consistent` | `kernels: vllm`).

The providers (spec.py says what one is) depend on the spec, not on each other or on this registry; vLLM itself is
imported only when its provider is built, never at tic import.
"""

from __future__ import annotations

from tic.harness.kernels.consistent_cpu import CPUProvider
from tic.harness.kernels.spec import KernelProvider
from tic.harness.kernels.vllm_provider import VLLMProvider

_PROVIDERS: dict[str, KernelProvider] = {}


def provider_for(kernels: str) -> KernelProvider:
    """The provider behind `kernels: consistent` (cpu) or `kernels: vllm`."""
    if kernels not in _PROVIDERS:
        if kernels == "consistent":
            _PROVIDERS[kernels] = CPUProvider()
        elif kernels == "vllm":
            _PROVIDERS[kernels] = VLLMProvider()
        else:
            raise ValueError(f"no kernel provider for kernels {kernels!r}")
    return _PROVIDERS[kernels]
