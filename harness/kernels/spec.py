"""What a kernel provider is: the operators tic's autograd wrappers call, each one's forward value and nothing else.

The autograd wrappers (autograd.py) add the backward. `consistent_cpu.CPUProvider` runs tic's row-invariant CPU
kernels, the ones `kernels: consistent` uses on both sides; `vllm_provider.VLLMProvider` calls the installed vLLM's
own kernels on the GPU, the ones its rollout runs. Both answer the same calls, so every wrapper is tested on CPU in
CI; `providers.provider_for` builds the one a config names.

Shapes (T = tokens of any leading shape, flattened by the caller where a kernel needs it):
  linear(x [.., K], w [N, K], b [N] | None) -> [.., N]
  rms_norm(x [.., D], w [D], eps[, offset]) -> [.., D]   (w * x_hat; with offset 1: (1 + w) * x_hat, Gemma)
  add_rms_norm(x, residual, w, eps[, offset]) -> (rms_norm(x + residual), x + residual)
  layer_norm(x [.., D], w [D] | None, b [D] | None, eps) -> torch's LayerNorm
  layer_norm_float32(x, w, b, eps) -> LayerNorm written out in float32, rounded once (CohereLayerNorm)
  cos_sin_cache(hf rotary module, config, P, dtype, device[, layer_type]) -> [P, R] (cos | sin halves)
  rotary(q [T, Hq, D], k [T, Hk, D], positions [T], cos_sin [P, R]) -> (q, k)   (neox style, R = rotary dims)
  rotary_interleaved(q, k, positions, cos_sin) -> (q, k)   (features 2i, 2i+1 paired: GLM, vLLM's non-neox style)
  silu_and_mul(x [.., 2I]) -> silu(x[..., :I]) * x[..., I:], rounded once
  gelu_tanh_and_mul(x [.., 2I]) -> gelu_tanh(x[..., :I]) * x[..., I:], rounded once
  softcap(x, cap) -> cap * tanh(x / cap)   (final logits)
  sigmoid_gate(g [T, 1], y [T, H]) -> sigmoid(g) * y, each rounded to the model dtype (a MoE's shared-expert gate)
  output_gate(g [.., H*D] | [.., H], y [.., H*D], function, per_head) -> y * function(g), the function (sigmoid,
      softplus) in float32 rounded to the model dtype, per element or per head (an attention's output gate)
  attention(q [B, H, Q, D], k/v [B, Hkv, K, D], mask bool [B, 1, Q, K], scale[, softcap][, window]) -> [B, Q, H, D]
      (window: the sliding window of the layer, already in the mask; softcap: on the scores)
  moe_route(logits [T, E], top_k, routing, bias [E] | None) -> (weights float32 [T, k], ids int64 [T, k])
      (routing: tic.harness.kernels.routing.Routing, or a softmax router's renormalise flag)
  moe_experts(x [T, H], weights [T, k], ids [T, k], gate_up [E, 2I, H], down [E, H, I]) -> [T, H]
  log_softmax(logits [T, V] in the model's dtype) -> float32 [T, V]   (as the rollout's sampler computes them)
Mamba-2 (one sequence per call; tic.harness.kernels.mamba says what the scan computes):
  mamba_conv(u [n, C], window [K-1, C], w [C, 1, K], bias [C] | None) -> silu(causal depthwise conv) [n, C]
  mamba_scan(x [n, H, P], dt [n, H], B/C [n, G, N], A_log/dt_bias/D [H], state float32 [H, P, N],
             buf_x [m, H, P], buf_dt [m, H], buf_B [m, G, N], chunk_size, dt_min, dt_max)
      -> (y float32 [n, H, P], the start state of the chunk the sequence ends in)
  gated_rms_norm(y [.., D], gate [.., D], w [D], group_size, eps, out_dtype) -> [.., D]
Mamba-1 (one sequence per call; the consistent provider only):
  mamba1_scan(u [n, I], dt_raw [n, I], B/C [n, N], z [n, I], A_log [I, N], D/dt_bias [I], state float32 [I, N])
      -> (y [n, I] = (C S + D u) * silu(z) in u's dtype, the state after the last token)
"""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's KV page size where its configuration resolves no other (a rollout that is not a vLLM engine, e.g. a dump)
DEFAULT_KV_BLOCK_SIZE = 16
# how a vLLM rollout computes a token's logprob: its V1 runner's sampler takes a float32 log_softmax of the logits;
# its V2 runner's sampler runs a Triton kernel of its own per row (max, then exp-sums block by block, then the log)
LOGPROB_RULES = ("log_softmax", "v2_sampler")


@dataclass(frozen=True)
class RolloutKernels:
    """What a training side on vLLM's kernels must match of the vLLM rollout it recomputes, as that engine
    resolved it: the KV page size (prefill pages K/V alike; FA3 picks its key tile from the paging) and the
    logprob rule of the runner vLLM picked (LOGPROB_RULES). A rollout dump says them in its options; these
    defaults are vLLM's where it does not."""
    kv_block_size: int = DEFAULT_KV_BLOCK_SIZE
    logprobs: str = "log_softmax"

    def __post_init__(self):
        if self.logprobs not in LOGPROB_RULES:
            raise ValueError(f"logprob rule {self.logprobs!r} (expected one of {', '.join(LOGPROB_RULES)})")

    @classmethod
    def of_runner(cls, kv_block_size: int, v2_runner: bool) -> "RolloutKernels":
        """For a vLLM rollout that ran its V2 model runner, or its V1 one."""
        return cls(kv_block_size, "v2_sampler" if v2_runner else "log_softmax")


class KernelProvider:
    name = "provider"
    kernels = "consistent"  # the tic.yaml kernels value it serves (coverage.py: which operator classes it has)
    # vLLM runs q/k/v and gate/up as one GEMM each over concatenated weights; a provider that mirrors it says so
    fuse_projections = False
