"""vLLM's FP8 kernels for the training forward (GPU; tic.harness.kernels.vllm_provider calls these).

- Linear: a block-FP8 layer as vLLM builds one for a checkpoint with quantization_config fp8 / weight_block_size,
  under the config an eager rollout of that checkpoint has: vLLM's own Fp8LinearMethod creates a layer holding the
  copy's codes and `weight_scale_inv`, prepares it (process_weights_after_loading: the scale layout its GEMM
  backend wants) and runs its `apply`, i.e.
  W8A8BlockFp8LinearOp: vLLM's per-token-group activation quantizer, then whichever block-FP8 GEMM vLLM selects
  on this GPU (DeepGEMM, CUTLASS, FlashInfer or Triton), the same selection its rollout layers make.
- Experts: vLLM's fused_experts with its FP8 W8A8 block quant config (activations quantized per token group
  inside, as the Triton fused-MoE path of Fp8MoEMethod runs them).
- FP8 KV cache (method 4.2): K/V written by vLLM's reshape_and_cache_flash into a private FP8 cache, the query
  quantized as the FlashAttention backend quantizes it, and the same varlen FlashAttention call reading the FP8
  pages with the (default, uncalibrated) scales 1.0.

vLLM is imported when one of these is first built or called, never at tic import.
"""

from __future__ import annotations

import contextlib
import weakref
from pathlib import Path

import torch


def rollout_vllm_config(model_dir: Path, dtype: torch.dtype):
    """The config vLLM builds for an eager rollout of this checkpoint: its quantization config (read from the
    checkpoint's quantization_config as the rollout reads it) and the model dtype, both of which Fp8LinearMethod and
    the kernel it selects read from the current config."""
    from vllm.config import ModelConfig, VllmConfig

    return VllmConfig(model_config=ModelConfig(model=str(model_dir), dtype=dtype, enforce_eager=True,
                                               skip_tokenizer_init=True))


class BlockFp8Linear:
    """vLLM's block-FP8 linear for one checkpoint's (codes, scales) copies. Each copy gets the method and layer the
    rollout's loader makes for a layer of its shape (Fp8LinearMethod.create_weights selects the GEMM kernel there),
    filled with the copy and prepared by process_weights_after_loading; rebuilt when the copy changed (requantized
    in place: tensor version; a new tensor: its own entry)."""

    def __init__(self, model_dir: Path, dtype: torch.dtype):
        self.config = rollout_vllm_config(model_dir, dtype)
        self.dtype = dtype
        self._layers: dict[int, tuple] = {}  # id(codes) -> (weakref, state, method, prepared layer)

    @contextlib.contextmanager
    def _vllm_context(self, device: torch.device):
        from vllm.config import set_current_vllm_config
        from vllm.utils.torch_utils import set_default_torch_dtype

        with set_current_vllm_config(self.config), set_default_torch_dtype(self.dtype), torch.device(device):
            yield

    def _layer(self, codes: torch.Tensor, scales: torch.Tensor) -> tuple:
        from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

        # an inference-mode tensor has no version counter, so nothing would show it changed: made every time
        fixed = not (codes.is_inference() or scales.is_inference())
        state = (codes.data_ptr(), codes._version, scales.data_ptr(), scales._version) if fixed else None
        held = self._layers.get(id(codes))
        if fixed and held is not None and held[0]() is codes and held[1] == state:
            return held[2:]
        self._layers = {k: v for k, v in self._layers.items() if v[0]() is not None}
        N, K = codes.shape
        # the prepared layer serves later training forwards too: normal tensors, even inside an inference-mode call
        with self._vllm_context(codes.device), torch.inference_mode(False), torch.no_grad():
            method = Fp8LinearMethod(self.config.quant_config)
            layer = torch.nn.Module()
            method.create_weights(layer, K, [N], K, N, self.dtype, weight_loader=None)
            # copies: vLLM may rewrite a layer's weight and scales in place while preparing them
            layer.weight.data.copy_(codes)
            layer.weight_scale_inv.data.copy_(scales)
            method.process_weights_after_loading(layer)
        if fixed:
            self._layers[id(codes)] = (weakref.ref(codes), state, method, layer)
        return method, layer

    def __call__(self, x, codes, scales, bias):
        method, layer = self._layer(codes, scales)
        with self._vllm_context(x.device):
            return method.apply(layer, x, bias)


def fused_experts_fp8(x, weights, ids, gu_q, gu_s, d_q, d_s, block, with_intermediate: bool = False):
    """vLLM's fused FP8 experts; with_intermediate: (out, the SiLU*mul rows the kernel quantized for the down
    projection, one per (token, top-k slot) in that order, or None where this vLLM's path did not show them)."""
    from vllm.model_executor.layers.fused_moe import fused_experts
    from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

    quant = fp8_w8a8_moe_quant_config(w1_scale=gu_s, w2_scale=d_s, block_shape=list(block))
    run = lambda: fused_experts(x.contiguous(), gu_q, d_q, weights, ids.to(torch.int32),  # noqa: E731
                                quant_config=quant)
    if not with_intermediate:
        return run()
    with _activation_outputs() as between:
        out = run()
    rows = ids.numel()
    got = torch.cat(between) if between else None
    return out, got if got is not None and got.shape[0] == rows else None


@contextlib.contextmanager
def _activation_outputs():
    """Copies of what the fused-MoE path's activation (apply_moe_activation: SiLU*mul) writes, call by call (the
    path runs it once per chunk of tokens), while inside."""
    import vllm.model_executor.layers.fused_moe.fused_moe as fused

    kept, real = [], getattr(fused, "apply_moe_activation", None)
    if real is None:
        yield kept
        return

    def recording(activation, output, input, *args, **kwargs):
        done = real(activation, output, input, *args, **kwargs)
        kept.append(output.detach().clone())
        return done

    fused.apply_moe_activation = recording
    try:
        yield kept
    finally:
        fused.apply_moe_activation = real


def fp8_kv_attention(vops, attn, q, k, v, slots, pages, block_size: int, **attn_kw):
    """Packed q [N, H, D], k/v [N, Hk, D] through the FP8 KV round trip; attn: the varlen FlashAttention entry,
    attn_kw its other arguments (cu_seqlens_q, seqused_k, block_table, ...)."""
    N, H, D = q.shape
    Hk = k.shape[1]
    one = torch.ones((), dtype=torch.float32, device=q.device)  # vLLM's q/k/v scales without calibrated ones
    k_cache = torch.zeros(pages.num_blocks, block_size, Hk, D, dtype=torch.uint8, device=q.device)
    v_cache = torch.zeros_like(k_cache)
    vops.reshape_and_cache_flash(k.contiguous(), v.contiguous(), k_cache, v_cache, slots, "fp8", one, one)
    qq, _ = vops.scaled_fp8_quant(q.reshape(N, H * D).contiguous(), one)
    descale = (pages.seq_lens.shape[0], Hk)
    out = torch.empty(N, H, v.shape[-1], dtype=q.dtype, device=q.device)  # the model dtype, as vLLM's buffer
    attn(q=qq.reshape(N, H, D), k=k_cache.view(torch.float8_e4m3fn), v=v_cache.view(torch.float8_e4m3fn), out=out,
         q_descale=one.expand(descale), k_descale=one.expand(descale), v_descale=one.expand(descale), **attn_kw)
    return out
