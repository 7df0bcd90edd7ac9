"""The vLLM provider's Mamba-2 calls: vLLM's own causal conv, chunked scan and gated RMSNorm, on the layouts vLLM's
MambaMixer2 (vllm/model_executor/layers/mamba/mamba_mixer2.py, 0.26) gives them in a prefill.

What the mixer passes, and so what these calls pass:
  conv: `causal_conv1d_fn` on the [conv_dim, tokens] transpose of the token-major input (channel-last), the
        [conv_dim, K] view of conv1d's weight, SiLU, a conv state per sequence and `has_initial_state` false at a
        sequence's start (the kernel then reads no state). The state sits in cache line NULL_BLOCK_ID + 1: vLLM
        reserves line NULL_BLOCK_ID (0) for padding, and its kernel skips a sequence mapped there, output unwritten.
  scan: `mamba_chunk_scan_combined_varlen` on x [tokens, H, P], the raw dt of the projection, A = -exp(A_log) in
        float32 (vLLM's loader computes it so), B/C [tokens, G, N], the config's chunk_size, D, z = None,
        dt_bias, dt_softplus, dt_limit (0, inf) whatever the config's time_step_limit (vLLM 0.26's mixer passes
        no other), the output written in the model dtype, chunks cut at multiples of chunk_size from
        the sequence's first token (vLLM's `compute_varlen_chunk_metadata`), no initial state at a sequence's
        start, the SSM state in MAMBA_STATE_DTYPE.
  norm: vLLM's own Mixer2RMSNormGated.forward_cuda at TP 1, called on a stand-in with the norm's settings: one
        group -> `rms_norm_gated` (Triton, norm_before_gate=False); several groups -> its torch `forward_native`
        (x * silu(gate) in float32, per-group RMS, rounded to the model dtype, times the weight), or, with the
        mamba-gated-norm-triton patch, `rms_norm_gated` per group.

A decode step of the wrapper (tic.harness.kernels.mamba_modules) replays the current chunk: the buffered tokens
and the new ones go through the same scan from the chunk's start state, and the new tokens' rows are kept. This
is exact if the scan computes a token's row from its chunk's start state and the chunk's tokens up to it alone,
whatever the chunk holds after it: its Triton kernels mask positions past the chunk's length to zero and reduce
within a chunk on tiles fixed by the autotuned config (the mamba-ssd-fixed-config patch pins one config in every
process, so the rollout and this process tile alike). The vLLM rollout's mamba-decode-replay patch rests on the
same claim; the GPU probe benchmarks/gpu/mamba_replay_probe.py and C4 on that rollout measure it.

An all-zero start state (and an all-zero conv window) is read as a sequence's start, where vLLM passes no initial
state: a continued sequence's state is never exactly zero in practice.
"""

from __future__ import annotations

import torch

# The SSM state's dtype between chunks: vLLM writes the chunk states in its mamba_ssm_cache_dtype and its scan reads
# them back, so the rollout must run with mamba_ssm_cache_dtype float32 (NemotronH's default in vLLM 0.26; Mamba2's
# "auto" is the model dtype) for the training side's bits to be the rollout's.
MAMBA_STATE_DTYPE = torch.float32
VLLM_DT_LIMIT = (0.0, float("inf"))  # what MambaMixer2 passes for every model (dt_min / dt_max are not read)


def _i32(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


class VLLMMambaKernels:
    """The Mamba-2 and Mamba-1 calls of the vLLM provider (spec.py lists their shapes); vLLM is imported on first
    use."""

    def mamba_conv(self, u, window, w, bias):
        from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn
        from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

        n, dim = u.shape
        if n == 0:
            return u.new_zeros(u.shape)
        # the window in a cache line of its own: vLLM's line NULL_BLOCK_ID is padding, a sequence mapped to it is
        # skipped by the kernel (its output left unwritten)
        line = NULL_BLOCK_ID + 1
        lines = torch.zeros(line + 1, *window.shape, dtype=u.dtype, device=u.device)
        lines[line] = window
        conv_states = lines.transpose(-1, -2)  # [lines, dim, K-1], as vLLM's SD layout
        has_state = torch.tensor([bool(window.any())], device=u.device)
        out = causal_conv1d_fn(u.t(), w.view(w.shape[0], w.shape[-1]), bias, conv_states=conv_states,
                               query_start_loc=_i32([0, n], u.device), cache_indices=_i32([line], u.device),
                               has_initial_state=has_state, activation="silu")
        return out.t()

    def mamba_scan(self, x, dt_raw, B, C, A_log, dt_bias, D, state, buf_x, buf_dt, buf_B, chunk_size, dt_min,
                   dt_max):
        from vllm.model_executor.layers.mamba.ops.ssd_combined import mamba_chunk_scan_combined_varlen
        from vllm.v1.attention.backends.mamba2_attn import compute_varlen_chunk_metadata

        m, n = buf_x.shape[0], x.shape[0]
        if n == 0:
            return x.new_zeros(x.shape, dtype=torch.float32), state
        dev, total = x.device, m + n
        xs = torch.cat([buf_x.to(x.dtype), x])
        dts = torch.cat([buf_dt.to(dt_raw.dtype), dt_raw])
        Bs = torch.cat([buf_B.to(B.dtype), B])
        Cs = torch.cat([C.new_zeros(m, *C.shape[1:]), C])  # a buffered token's C reaches its own row alone
        cu_chunks, last_chunk, seq_idx = compute_varlen_chunk_metadata(_i32([0, total], dev), int(chunk_size))
        start = state if bool(state.any()) else None
        out = torch.empty(xs.shape, dtype=x.dtype, device=dev)
        states = mamba_chunk_scan_combined_varlen(
            xs, dts, -torch.exp(A_log.float()), Bs, Cs, chunk_size=int(chunk_size), cu_seqlens=_i32([0, total], dev),
            cu_chunk_seqlens=cu_chunks, last_chunk_indices=last_chunk, seq_idx=seq_idx, out=out, D=D, z=None,
            dt_bias=dt_bias, initial_states=None if start is None else start[None].to(MAMBA_STATE_DTYPE),
            dt_softplus=True, dt_limit=VLLM_DT_LIMIT, return_intermediate_states=True,
            state_dtype=MAMBA_STATE_DTYPE)
        # the start state of the chunk the stream ends in: the last chunk's end state at a boundary, else the one
        # before it (or the stream's own start state when it ends in its first chunk)
        if total % int(chunk_size) == 0:
            ends_in = states[-1]
        else:
            ends_in = states[-2] if states.shape[0] > 1 else state
        return out[m:].float(), ends_in.float()

    def mamba1_scan(self, u, dt_raw, B, C, z, A_log, D, dt_bias, state):
        """A Mamba-1 sequence through vLLM's decode kernel (`selective_state_update`, Triton) one token at a time,
        as the rollout's mamba1-prefill-steps patch prefills and vLLM decodes: vLLM's batch-free default launch
        config, each token's rows fresh and token-major as the patch gathers them (Triton specializes on their
        alignment), the state in a cache line of its own (line NULL_BLOCK_ID is padding) in float32, the
        rollout's mamba_ssm_cache_dtype. Returns (y [n, I] in u's dtype, the state after the last token)."""
        from vllm.model_executor.layers.mamba.ops import mamba_ssm

        n = u.shape[0]
        A = -torch.exp(A_log.float())
        line = mamba_ssm.NULL_BLOCK_ID + 1
        lines = torch.zeros(line + 1, *state.shape, dtype=torch.float32, device=u.device)
        lines[line] = state
        index = _i32([line], u.device)
        y = torch.empty_like(u)
        with mamba_ssm.override_ssm_config(mamba_ssm._get_default_ssm_launch_config(A.shape[-1], False)):
            for t in range(n):
                out = torch.empty_like(u[t:t + 1])
                mamba_ssm.selective_state_update(
                    lines, u[t:t + 1].clone(), dt_raw[t:t + 1].clone(), A, B[t:t + 1].clone(), C[t:t + 1].clone(),
                    D, dt_bias, z=z[t:t + 1].clone(), dt_softplus=True, state_batch_indices=index,
                    dst_state_batch_indices=index, out=out)
                y[t] = out[0]
        return y, lines[line].clone()

    def gated_rms_norm(self, y, gate, w, group_size, eps, out_dtype):
        shape = y.shape
        x = y.to(out_dtype).reshape(-1, shape[-1])  # vLLM's scan wrote its output in the model dtype
        z = gate.reshape(-1, shape[-1])
        return _gated_norm_call(w, group_size, eps)(x, z).reshape(shape)


def _gated_norm_call(w: torch.Tensor, group_size: int, eps: float):
    """vLLM's own Mixer2RMSNormGated.forward_cuda (TP 1) on a stand-in holding this norm's settings: the code the
    rollout's mixer runs, with whatever a rollout patch (mamba-gated-norm-triton) made of it."""
    import types

    from vllm.model_executor.layers.mamba.mamba_mixer2 import Mixer2RMSNormGated

    width = w.shape[-1]
    norm = types.SimpleNamespace(weight=w, variance_epsilon=eps, group_size=group_size, n_groups=width // group_size,
                                 tp_size=1, tp_rank=0, full_hidden_size=width, per_rank_hidden_size=width,
                                 use_rms_norm=True)
    norm.forward_native = types.MethodType(Mixer2RMSNormGated.forward_native, norm)
    return types.MethodType(Mixer2RMSNormGated.forward_cuda, norm)
