"""A stand-in vLLM with the module paths the bundled patches touch (CPU tests of tic.patches)."""

from __future__ import annotations

import textwrap
from pathlib import Path

FAKE = {
    "vllm/__init__.py": "__version__ = '{version}'\n",
    "vllm/v1/__init__.py": "", "vllm/v1/attention/__init__.py": "", "vllm/v1/attention/backends/__init__.py": "",
    "vllm/v1/attention/backends/flash_attn.py": """
        def flash_attn_varlen_func(**kwargs):
            return kwargs

        def use_cascade_attention(*args, **kwargs):
            return True
        """,
    "vllm/model_executor/__init__.py": "", "vllm/model_executor/layers/__init__.py": "",
    "vllm/model_executor/layers/utils.py": """
        import torch

        def default_unquantized_gemm(layer, x, weight, bias=None):
            # like cuBLAS, another kernel (here: split-K) above a row count
            x2 = x.reshape(-1, x.shape[-1])
            if x2.shape[0] > 64:
                k = x2.shape[1] // 2
                y = x2[:, :k] @ weight[:, :k].T + x2[:, k:] @ weight[:, k:].T
            else:
                y = x2 @ weight.T
            y = y if bias is None else y + bias
            return y.view(*x.shape[:-1], weight.shape[0])

        def dispatch_unquantized_gemm():
            return default_unquantized_gemm
        """,
    "vllm/model_executor/layers/linear.py": "from vllm.model_executor.layers.utils import dispatch_unquantized_gemm\n",
    "vllm/_custom_ops.py": """
        import torch

        def rms_norm(out, input, weight, epsilon):
            torch.ops._C.rms_norm(out, input, weight, epsilon)

        def fused_add_rms_norm(input, residual, weight, epsilon):
            torch.ops._C.fused_add_rms_norm(input, residual, weight, epsilon)

        def moe_sum(input, output, topk_ids=None, expert_map=None):
            # like _moe_C.moe_sum: the k slots added one after another, each add rounded to the model dtype
            acc = input[:, 0].clone()
            for k in range(1, input.shape[1]):
                acc = acc + input[:, k]
            output.copy_(acc)
        """,
    "vllm/distributed/__init__.py": "",
    "vllm/distributed/parallel_state.py": "_EP = None  # vLLM's expert-parallel GroupCoordinator once initialised\n",
    "vllm/kernels/__init__.py": "",
    "vllm/kernels/vllm_c.py": """
        import torch
        from vllm import ir

        def rms_norm(x, weight, epsilon, variance_size=None):
            output = torch.empty(x.shape, device=x.device, dtype=x.dtype)
            torch.ops._C.rms_norm(output, x, weight, epsilon)
            return output

        def fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size=None):
            torch.ops._C.fused_add_rms_norm(x, x_residual, weight, epsilon)
            return x, x_residual

        ir.ops.rms_norm.impls["vllm_c"] = ir.Impl(rms_norm)
        ir.ops.fused_add_rms_norm.impls["vllm_c"] = ir.Impl(fused_add_rms_norm)
        """,
    "vllm/ir/__init__.py": """
        import torch

        class Impl:
            def __init__(self, fn):
                self.impl_fn = fn

        class _Op:
            def __init__(self, native):
                self.impls = {"native": Impl(native)}

        def _rms_norm(x, weight, epsilon, variance_size=None):  # vllm/ir/ops/layernorm.py's native code
            orig = x.dtype
            x = x.to(torch.float32)
            x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + epsilon)
            return (x.to(weight.dtype) * weight if weight is not None else x).to(orig)

        def _fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size=None):
            orig = x.dtype
            x = x.to(torch.float32) + x_residual.to(torch.float32)
            res = x.to(orig)
            x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + epsilon)
            return (x.to(weight.dtype) * weight if weight is not None else x).to(orig), res

        class ops:
            rms_norm = _Op(_rms_norm)
            fused_add_rms_norm = _Op(_fused_add_rms_norm)
        """,
    "vllm/envs.py": "VLLM_BATCH_INVARIANT = False\nVLLM_USE_DEEP_GEMM = True\n",
    "vllm/model_executor/kernels/__init__.py": "", "vllm/model_executor/kernels/linear/__init__.py": "",
    "vllm/model_executor/kernels/linear/scaled_mm/__init__.py": "",
    "vllm/model_executor/kernels/linear/scaled_mm/flashinfer.py": """
        import vllm.envs as envs

        def dynamic_blockscale_gemm(rows):
            # like _dynamic_flashinfer_deepgemm_blockscale_gemm_impl: the kernel follows the row count
            if envs.VLLM_BATCH_INVARIANT:
                return "deepgemm"
            return "flashinfer" if rows < 32 else "deepgemm"
        """,
    "vllm/plugins/__init__.py": """
        from importlib.metadata import entry_points

        def load_general_plugins():
            for ep in entry_points(group="vllm.general_plugins"):
                ep.load()()
        """,
}


def make_fake_vllm(root: Path, version: str = "0.26.0") -> Path:
    for rel, text in FAKE.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text).lstrip().replace("{version}", version))
    return root
