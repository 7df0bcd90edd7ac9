"""Result records: what a gate measured, its verdict, and what it ran on."""

from __future__ import annotations

import os
import platform
import time
from datetime import datetime, timezone
from importlib import metadata
from typing import Any, Literal

from pydantic import BaseModel, Field

Verdict = Literal["pass", "fail", "unavailable", "error", "skipped"]

# Environment variables that change numerics or kernel choice; recorded with every result.
NUMERIC_ENV_PREFIXES = ("NCCL_", "CUBLAS_", "CUDNN_", "NVIDIA_TF32", "TORCH_", "VLLM_", "OMP_", "MKL_",
                        "OPENBLAS_", "CUDA_", "PYTORCH_", "TRITON_", "DG_", "DEEPEP_")
NUMERIC_ENV_NAMES = ("TIC_PATCHES", "VLLM_BATCH_INVARIANT", "CUBLAS_WORKSPACE_CONFIG", "VLLM_ATTENTION_BACKEND",
                     "VLLM_ENABLE_V1_MULTIPROCESSING", "TIC_CACHE")
_PACKAGES = ("torch", "transformers", "vllm", "triton", "safetensors", "numpy", "tic-consistency")


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def environment_fingerprint(parallel: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the numbers ran on; `parallel` is each side's rank layout from tic.yaml."""
    import torch

    env = {k: v for k, v in sorted(os.environ.items())
           if k in NUMERIC_ENV_NAMES or k.startswith(NUMERIC_ENV_PREFIXES)}
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
    else:
        device = f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"
    return {
        "packages": {p: v for p in _PACKAGES if (v := _version(p))},
        "python": platform.python_version(),
        "device": device,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "env": env,
        "patches": _active_patches(),
        **({"parallel": parallel} if parallel is not None else {}),
    }


def _active_patches() -> list[str]:
    """Bundled patches active in this process, read back from the patched objects (not from a setting)."""
    from tic import patches

    return patches.active()


class GateResult(BaseModel):
    gate: str
    title: str
    verdict: Verdict
    reason: str = ""
    key_figure: str = ""
    metrics: dict[str, Any] = Field(default_factory=dict)
    details: dict[str, Any] = Field(default_factory=dict)
    evidence: list[str] = Field(default_factory=list)
    config_hash: str = ""
    model_hash: str = ""
    environment: dict[str, Any] = Field(default_factory=dict)
    tic_version: str = ""
    started_at: str = Field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    duration_s: float = 0.0

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    def age_s(self) -> float:
        t = datetime.fromisoformat(self.started_at)
        return time.time() - t.timestamp()
