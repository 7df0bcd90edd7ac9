"""The environment fingerprint: what a measurement ran on (device, driver, packages, patches, env vars that
change numerics or transport), and the comparison of two fingerprints that C10 refuses on."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from importlib import metadata
from typing import Any

from tic import patches

# Environment variables that change numerics, kernel choice, threading or transport.
NUMERIC_ENV_PREFIXES = ("NCCL_", "CUBLAS_", "CUDNN_", "NVIDIA_TF32", "TORCH_", "VLLM_", "OMP_", "MKL_",
                        "OPENBLAS_", "CUDA_", "PYTORCH_", "TRITON_", "DG_", "DEEPEP_", "NVSHMEM_", "UCX_",
                        "GLOO_", "FI_")
NUMERIC_ENV_NAMES = ("TIC_PATCHES", "VLLM_BATCH_INVARIANT", "CUBLAS_WORKSPACE_CONFIG", "VLLM_ATTENTION_BACKEND",
                     "VLLM_ENABLE_V1_MULTIPROCESSING", "TIC_CACHE")
PACKAGES = ("torch", "transformers", "vllm", "triton", "safetensors", "numpy", "tic-consistency", "deep_gemm",
            "flashinfer-python", "deep_ep")


def installed_version(pkg: str) -> str | None:
    """The installed distribution's version, or None."""
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


# Set by vLLM or torch itself while an engine runs (an IPC buffer's name, Triton's autotuning log switch; in a
# compiled mode, once an in-process engine has compiled, Triton's cache folder and the ptxas that torch ships):
# none is a setting anybody chose, so a side measured before the first compilation and one measured after it
# would otherwise differ in them.
RUNTIME_SET_ENV = ("VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME", "TRITON_PRINT_AUTOTUNING", "TRITON_CACHE_DIR",
                   "TRITON_PTXAS_PATH")


def numeric_env(overlay: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, **(overlay or {})}
    return {k: v for k, v in sorted(env.items())
            if (k in NUMERIC_ENV_NAMES or k.startswith(NUMERIC_ENV_PREFIXES)) and k not in RUNTIME_SET_ENV}


def _gpu() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {}
    out: dict[str, Any] = {"gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                           "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()}
    if shutil.which("nvidia-smi"):
        try:
            r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20)
            out["driver"] = r.stdout.split("\n")[0].strip() or None
        except (OSError, subprocess.SubprocessError):
            out["driver"] = None
    return out


def active_patches() -> list[str]:
    """Bundled patches active in this process, read back from the patched objects (not from a setting)."""
    return sorted(patches.active())


def environment_fingerprint(env_overlay: dict[str, str] | None = None) -> dict[str, Any]:
    import torch

    if torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
    else:
        device = f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"
    return {
        "packages": {p: v for p in PACKAGES if (v := installed_version(p))},
        "python": platform.python_version(),
        "device": device,
        **_gpu(),
        "torch_threads": torch.get_num_threads(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "patches": active_patches(),
        "env": numeric_env(env_overlay),
    }


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
            if not v:
                out[key] = {}
        else:
            out[key] = v
    return out


def differences(a: dict, b: dict, allowed: set[str] = frozenset()) -> list[str]:
    """Every flattened key whose value differs between two fingerprints, except the allowed ones
    ('a.b' allows that key and everything under it)."""
    fa, fb = flatten(a), flatten(b)
    out = []
    for k in sorted(set(fa) | set(fb)):
        if any(k == x or k.startswith(x + ".") for x in allowed):
            continue
        if fa.get(k, "<unset>") != fb.get(k, "<unset>"):
            out.append(f"{k}: {fa.get(k, '<unset>')!r} vs {fb.get(k, '<unset>')!r}")
    return out
