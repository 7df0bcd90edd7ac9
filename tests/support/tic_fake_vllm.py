"""A stand-in vLLM with the module paths the bundled patches touch (CPU tests of tic.patches)."""

from __future__ import annotations

import textwrap
from pathlib import Path

FAKE = {
    "vllm/__init__.py": "__version__ = '{version}'\n",
    "vllm/v1/__init__.py": "", "vllm/v1/attention/__init__.py": "", "vllm/v1/attention/backends/__init__.py": "",
    "vllm/v1/attention/backends/utils.py": "NULL_BLOCK_ID = 0  # cache line 0: padding, skipped by the Mamba kernels\n",
    "vllm/v1/attention/backends/flash_attn.py": """
        def flash_attn_varlen_func(**kwargs):
            return kwargs

        def get_scheduler_metadata(**kwargs):
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
    # Mamba-2 (tic.harness.kernels.vllm_mamba, the mamba-ssd-fixed-config patch): the entry points vLLM's
    # MambaMixer2 calls, checking the layouts vLLM's kernels assert, and recording each call
    "vllm/model_executor/layers/mamba/__init__.py": "", "vllm/model_executor/layers/mamba/ops/__init__.py": "",
    "vllm/model_executor/layers/mamba/ops/causal_conv1d.py": """
        import torch
        import torch.nn.functional as F

        CALLS = []

        def causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, cache_indices=None,
                             has_initial_state=None, activation="silu", **kw):
            assert x.stride(0) == 1 and x.stride(1) > 1, "Need to run in channel-last layout"
            dim, K = weight.shape
            assert weight.stride(1) == 1 and conv_states.shape[1:] == (dim, K - 1)
            CALLS.append(dict(x_shape=tuple(x.shape), has_initial_state=has_initial_state.tolist(),
                              activation=activation))
            out = torch.full_like(x, float("nan"))  # the kernel writes nothing for a skipped sequence
            qsl = query_start_loc.tolist()
            for i, (s, e) in enumerate(zip(qsl[:-1], qsl[1:])):
                line = int(cache_indices[i])
                if line == 0:  # vLLM's null block (padding): skipped
                    continue
                window = conv_states[line] if bool(has_initial_state[i]) else x.new_zeros(dim, K - 1)
                full = torch.cat([window.to(x.dtype), x[:, s:e]], dim=1)
                acc = bias[:, None].expand(dim, e - s) if bias is not None else x.new_zeros(dim, e - s)
                for k in range(K):  # tap by tap, as the kernel accumulates: a token's value is its own
                    acc = acc + full[:, k:k + e - s] * weight[:, k:k + 1]
                for t in range(e - s):  # elementwise math per token: CPU vector code varies with the length
                    out[:, s + t] = F.silu(acc[:, t].contiguous())
                conv_states[line] = full[:, -(K - 1):]
            return out

        def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None,
                                 **kw):
            # vLLM's decode conv: its own kernel (here the taps summed newest first, another rounding order)
            dim, K = weight.shape
            out = torch.full_like(x, float("nan"))
            for r in range(x.shape[0]):
                line = int(conv_state_indices.reshape(x.shape[0], -1)[r, 0])
                if line == 0:  # vLLM's null block (padding): skipped
                    continue
                full = torch.cat([conv_state[line], x[r][:, None]], dim=1)
                acc = bias.clone() if bias is not None else x.new_zeros(dim)
                for k in reversed(range(K)):
                    acc = acc + full[:, k] * weight[:, k]
                out[r] = F.silu(acc.contiguous())
                conv_state[line] = full[:, 1:]
            return out
        """,
    "vllm/model_executor/layers/mamba/ops/ssd_combined.py": """
        import torch
        import torch.nn.functional as F

        CALLS = []

        def _chunk(S, x, dt, A, B, C, D, Q):
            # the SSD decomposition of one chunk, every reduction over the chunk padded to Q positions (as the
            # kernel's tiles): a token's row does not depend on the tokens after it
            n, H, P = x.shape
            pad = lambda t: torch.cat([t, t.new_zeros(Q - n, *t.shape[1:])])  # noqa: E731
            rep = lambda t: t.float().repeat_interleave(H // t.shape[1], dim=1)  # noqa: E731
            xs, dts, Bs, Cs = pad(x.float()), pad(dt), pad(rep(B)), pad(rep(C))
            acum = torch.cumsum(A[None] * dts, dim=0)  # [Q, H]
            causal = torch.ones(Q, Q, dtype=torch.bool).tril()
            decay = torch.exp((acum[:, None] - acum[None]).masked_fill(~causal[..., None], float("-inf")))
            w = (Cs[:, None] * Bs[None]).sum(-1) * decay * dts[None]  # [Q(row), Q(col), H]
            y = (w[..., None] * xs[None]).sum(1) + (S[None] * Cs[:, :, None]).sum(-1) * torch.exp(acum)[..., None]
            y = y + D.float()[None, :, None] * xs
            tail = torch.exp(acum[-1:] - acum) * dts  # [Q, H]
            end = torch.exp(acum[-1])[:, None, None] * S + (tail[..., None, None] * xs[..., None] * Bs[:, :, None]).sum(0)
            return y[:n], end

        def mamba_chunk_scan_combined_varlen(x, dt, A, B, C, chunk_size, cu_seqlens, cu_chunk_seqlens,
                                             last_chunk_indices, seq_idx, out, D=None, z=None, dt_bias=None,
                                             initial_states=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                                             return_intermediate_states=False, state_dtype=None):
            CALLS.append(dict(chunks=cu_chunk_seqlens.tolist(), initial=initial_states is not None,
                              dt_softplus=dt_softplus, dt_limit=dt_limit, state_dtype=state_dtype,
                              out_dtype=out.dtype, z=z, A_dtype=A.dtype))
            H, P, N = x.shape[1], x.shape[2], B.shape[2]
            dt = dt.float() + dt_bias.float()
            if dt_softplus:  # per token: CPU vector code varies with the length
                dt = torch.stack([F.softplus(row) for row in dt])
            dt = dt.clamp(*dt_limit)
            bounds, seqs, states = cu_chunk_seqlens.tolist(), seq_idx.tolist(), []
            for c, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
                s = seqs[c]
                first = c == 0 or seqs[c - 1] != s
                S = (initial_states[s].float() if initial_states is not None else x.new_zeros(H, P, N).float()) \
                    if first else states[-1].float()
                y, end = _chunk(S, x[a:b], dt[a:b], A, B[a:b], C[a:b], D, chunk_size)
                out[a:b] = y.to(out.dtype)
                states.append(end.to(state_dtype))
            states = torch.stack(states)
            return states if return_intermediate_states else states[last_chunk_indices]
        """,
    "vllm/model_executor/layers/mamba/ops/ssu_dispatch.py": """
        import torch
        import torch.nn.functional as F

        def selective_state_update(state, x, dt, A, B, C, D, dt_bias, z=None, dt_softplus=False,
                                   state_batch_indices=None, dst_state_batch_indices=None, out=None, **kw):
            # vLLM's decode: one step of the recurrence S <- exp(A dt) S + dt B x, y = C S + D x
            if x.dim() == 2:  # a Mamba-1 mixer's call: x [batch, dim], B/C [batch, N], no heads
                from vllm.model_executor.layers.mamba.ops.mamba_ssm import selective_state_update as ssu
                return ssu(state, x, dt, A, B, C, D, dt_bias, z=z, dt_softplus=dt_softplus,
                           state_batch_indices=state_batch_indices, dst_state_batch_indices=dst_state_batch_indices,
                           out=out, **kw)
            H = x.shape[1]
            for r in range(x.shape[0]):
                s = int(state_batch_indices.reshape(x.shape[0], -1)[r, 0])
                if s == 0:  # vLLM's null block (padding): skipped
                    continue
                d = dt[r].float() + dt_bias.float()
                d = F.softplus(d) if dt_softplus else d
                Bh, Ch = (t[r].float().repeat_interleave(H // t.shape[1], dim=0) for t in (B, C))
                S = state[s].float() * torch.exp(A * d[..., None]) + (d * x[r].float())[..., None] * Bh[:, None]
                state[s] = S.to(state.dtype)
                out[r] = ((S * Ch[:, None]).sum(-1) + D.float() * x[r].float()).to(out.dtype)
        """,
    "vllm/forward_context.py": """
        _forward_context = None

        class ForwardContext:
            def __init__(self, attn_metadata):
                self.attn_metadata = attn_metadata

        def get_forward_context():
            return _forward_context

        def set_forward_context(ctx):
            global _forward_context
            _forward_context = ctx
        """,
    "vllm/model_executor/layers/mamba/abstract.py": """
        from types import SimpleNamespace

        class MambaBase:
            def get_kv_cache_spec(self, vllm_config):
                # vLLM 0.26's MambaSpec holds the states the layer's two sizing methods name
                return SimpleNamespace(shapes=tuple(self.get_state_shape()), dtypes=self.get_state_dtype())
        """,
    "vllm/model_executor/layers/mamba/mamba_mixer2.py": """
        import torch

        from vllm.forward_context import get_forward_context
        from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_update
        from vllm.model_executor.layers.mamba.ops.ssd_combined import mamba_chunk_scan_combined_varlen
        from vllm.model_executor.layers.mamba.ops.layernorm_gated import rms_norm_gated
        from vllm.model_executor.layers.mamba.ops.ssu_dispatch import selective_state_update
        from vllm.model_executor.layers.mamba.abstract import MambaBase

        class Mixer2RMSNormGated:
            # vLLM 0.26's gated norm at TP 1: Triton for one group, torch's forward_native for several
            def forward_native(self, x, gate):
                input_dtype = x.dtype
                x = x * torch.nn.functional.silu(gate.to(torch.float32))
                *prefix_dims, hidden_dim = x.shape
                x_grouped = x.view(*prefix_dims, hidden_dim // self.group_size, self.group_size)
                x_grouped = x_grouped * torch.rsqrt(x_grouped.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
                return self.weight * x_grouped.view(*prefix_dims, hidden_dim).to(input_dtype)

            def forward_cuda(self, x, gate):
                if ((self.n_groups % self.tp_size) != 0) or self.n_groups != 1:
                    return self.forward_native(x, gate)
                return rms_norm_gated(x, self.weight.data, bias=None, z=gate, eps=self.variance_epsilon,
                                      norm_before_gate=False)

        class MambaMixer2(MambaBase):
            # conv_ssm_forward as vLLM 0.26's, without prefix caching and speculative decoding (I, H, P, G, N:
            # intermediate size, heads, head dim, groups, state size; kv_cache = (conv [slots, K-1, dim], ssm)),
            # and its state sizing (K: conv kernel)
            def get_state_dtype(self):
                from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator
                return MambaStateDtypeCalculator.mamba2_state_dtype(self.model_config.dtype, "auto",
                                                                    self.cache_config.mamba_ssm_cache_dtype)

            def get_state_shape(self):
                from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
                return MambaStateShapeCalculator.mamba2_state_shape(
                    intermediate_size=self.I, tp_world_size=1, n_groups=self.G, num_heads=self.H, head_dim=self.P,
                    state_size=self.N, conv_kernel=self.K, num_spec=0)

            def conv_ssm_forward(self, projected_states, output):
                _, ssm_state_dtype = self.get_state_dtype()  # as vLLM's SSD kernel warmup reads it
                I, H, P, G, N = self.I, self.H, self.P, self.G, self.N
                xBC, dt = torch.split(projected_states[..., I:], [I + 2 * G * N, H], dim=-1)
                m = get_forward_context().attn_metadata[self.prefix]
                conv_state, ssm_state = self.kv_cache[0].transpose(-1, -2), self.kv_cache[1]
                nd, npt, ndt = m.num_decodes, m.num_prefill_tokens, m.num_decode_tokens
                xBC_d, xBC_p = torch.split(xBC[:ndt + npt], [ndt, npt])
                dt_d, dt_p = torch.split(dt[:ndt + npt], [ndt, npt])
                out_d, out_p = torch.split(output[:ndt + npt], [ndt, npt])
                split = lambda t: torch.split(t, [I, G * N, G * N], dim=-1)  # noqa: E731
                if m.num_prefills:
                    xBC_p = causal_conv1d_fn(xBC_p.transpose(0, 1), self.conv_weights, self.bias,
                                             conv_states=conv_state, query_start_loc=m.query_start_loc_p,
                                             cache_indices=m.state_indices_tensor_p,
                                             has_initial_state=m.has_initial_states_p, activation="silu"
                                             ).transpose(0, 1)
                    x, B, C = split(xBC_p)
                    init = None
                    if m.prep_initial_states:
                        init = torch.where(m.has_initial_states_p[:, None, None, None],
                                           ssm_state[m.state_indices_tensor_p], 0)
                    states = mamba_chunk_scan_combined_varlen(
                        x.reshape(npt, H, P), dt_p, self.A, B.reshape(npt, G, N), C.reshape(npt, G, N),
                        chunk_size=self.Q, D=self.D, z=None, dt_bias=self.dt_bias, seq_idx=m.seq_idx_p,
                        cu_seqlens=m.query_start_loc_p, cu_chunk_seqlens=m.cu_chunk_seqlen_p,
                        last_chunk_indices=m.last_chunk_indices_p, initial_states=init,
                        return_intermediate_states=False, dt_softplus=True, dt_limit=(0.0, float("inf")),
                        out=out_p.view(npt, H, P), state_dtype=ssm_state.dtype)
                    ssm_state[m.state_indices_tensor_p] = states
                if nd:
                    xBC_d = causal_conv1d_update(xBC_d, conv_state, self.conv_weights, self.bias, "silu",
                                                 conv_state_indices=m.state_indices_tensor_d,
                                                 num_accepted_tokens=None)
                    x, B, C = split(xBC_d)
                    selective_state_update(
                        ssm_state, x.reshape(nd, H, P), dt_d[:, :, None].expand(-1, -1, P),
                        self.A[:, None, None].expand(-1, P, N).float(), B.reshape(nd, G, N), C.reshape(nd, G, N),
                        self.D[:, None].expand(-1, P), self.dt_bias[:, None].expand(-1, P), dt_softplus=True,
                        state_batch_indices=m.state_indices_tensor_d, dst_state_batch_indices=m.state_indices_tensor_d,
                        out=out_d.view(nd, H, P))
        """,
    "vllm/model_executor/layers/mamba/ops/layernorm_gated.py": """
        import torch

        CALLS = []

        def rms_norm_gated(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
            CALLS.append(dict(shape=tuple(x.shape), group_size=group_size, norm_before_gate=norm_before_gate))
            h = x.float() * torch.nn.functional.silu(z.float())
            g = h.view(*h.shape[:-1], -1, group_size or h.shape[-1])  # one program per row and group
            h = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)).view(h.shape)
            return (h * weight.float()).to(x.dtype)
        """,
    "vllm/model_executor/layers/mamba/ops/ssd_chunk_state.py": """
        class Autotuner:  # triton.runtime.Autotuner's configs and cache
            def __init__(self, *configs):
                self.configs, self.cache = list(configs), {}

        _chunk_cumsum_fwd_kernel = Autotuner("h2", "h4")
        _chunk_state_fwd_kernel = Autotuner("m32", "m64")
        """,
    "vllm/model_executor/layers/mamba/ops/ssd_bmm.py": """
        from vllm.model_executor.layers.mamba.ops.ssd_chunk_state import Autotuner

        _bmm_chunk_fwd_kernel = Autotuner("m128", "m64")
        """,
    "vllm/model_executor/layers/mamba/ops/ssd_state_passing.py": """
        from vllm.model_executor.layers.mamba.ops.ssd_chunk_state import Autotuner

        _state_passing_fwd_kernel = Autotuner("b64", "b128")
        """,
    "vllm/model_executor/layers/mamba/ops/ssd_chunk_scan.py": """
        from vllm.model_executor.layers.mamba.ops.ssd_chunk_state import Autotuner

        _chunk_scan_fwd_kernel = Autotuner("m32", "m64")
        """,
    "vllm/v1/attention/backends/mamba2_attn.py": """
        import torch

        def compute_varlen_chunk_metadata(query_start_loc, chunk_size):
            q = query_start_loc.tolist()
            lens, seq, last = [], [], []
            for b, (s, e) in enumerate(zip(q[:-1], q[1:])):
                pos = s
                while pos < e:
                    take = min(chunk_size - pos % chunk_size, e - pos)
                    lens.append(take)
                    seq.append(b)
                    pos += take
                last.append(len(lens) - 1)
            cu = [0]
            for n in lens:
                cu.append(cu[-1] + n)
            i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
            return i32(cu), i32(last), i32(seq)
        """,
    "vllm/model_executor/models/__init__.py": "",
    "vllm/model_executor/models/commandr.py": """
        import torch

        def layer_norm_func(hidden_states, weight, variance_epsilon):  # vLLM compiles it; eager here
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            mean = hidden_states.mean(-1, keepdim=True)
            variance = (hidden_states - mean).pow(2).mean(-1, keepdim=True)
            hidden_states = (hidden_states - mean) * torch.rsqrt(variance + variance_epsilon)
            hidden_states = weight.to(torch.float32) * hidden_states
            return hidden_states.to(input_dtype)

        class LayerNorm(torch.nn.Module):
            def __init__(self, weight, eps=1e-5):
                super().__init__()
                self.weight = torch.nn.Parameter(weight)
                self.variance_epsilon = eps

            def forward(self, hidden_states, residuals=None):
                return layer_norm_func(hidden_states, self.weight, self.variance_epsilon), residuals
        """,
    # Mamba-1 (the mamba1-prefill-steps patch, the vLLM provider's mamba1_scan): vLLM 0.26's MambaMixer prefills
    # with selective_scan_fn (a block-parallel scan: here the state of every token from cumulative decays, another
    # rounding order) and decodes with the Triton selective_state_update, whose launch config comes from a table
    # keyed by the batch (here: the order of the sum over the state dimension follows it)
    "vllm/model_executor/layers/mamba/ops/mamba_ssm.py": """
        import contextlib

        import torch
        import torch.nn.functional as F

        NULL_BLOCK_ID = 0
        _ssm_config_override = None
        CONFIGS = []

        def _softplus(d):  # as the kernels' softplus: linear above 20
            return torch.where(d <= 20.0, torch.log(torch.exp(d) + 1), d)

        def _get_default_ssm_launch_config(dstate, is_blackwell):
            return (32, 4) if dstate <= 16 else (16, 4)

        def try_get_optimal_ssm_config(headdim, dstate, batch, nheads, cache_dtype, is_blackwell):
            if _ssm_config_override is not None:
                return _ssm_config_override
            return (16, 8) if batch * nheads <= 4 else (32, 4)  # a tuned table's closest entry

        @contextlib.contextmanager
        def override_ssm_config(config):
            global _ssm_config_override
            prev, _ssm_config_override = _ssm_config_override, config
            try:
                yield
            finally:
                _ssm_config_override = prev

        def selective_state_update(state, x, dt, A, B, C, D, dt_bias, z=None, dt_softplus=False,
                                   state_batch_indices=None, dst_state_batch_indices=None,
                                   null_block_id=NULL_BLOCK_ID, out=None, is_blackwell=False, **kw):
            # Mamba-1 layouts: state [lines, dim, N], x/dt/z/out [batch, dim], A [dim, N], B/C [batch, N]
            cfg = try_get_optimal_ssm_config(x.shape[-1], A.shape[-1], x.shape[0], 1, str(state.dtype), is_blackwell)
            CONFIGS.append(cfg)
            for r in range(x.shape[0]):
                s = r if state_batch_indices is None else int(state_batch_indices.reshape(-1)[r])
                if state_batch_indices is not None and s == null_block_id:
                    continue
                d = dt[r].float() + dt_bias.float()
                d = _softplus(d) if dt_softplus else d
                S = state[s].float() * torch.exp(A * d[:, None]) + (d * x[r].float())[:, None] * B[r].float()[None]
                state[s] = S.to(state.dtype)
                terms = S * C[r].float()[None]
                y = terms.sum(-1) if cfg == (32, 4) else terms.flip(-1).cumsum(-1)[:, -1]
                y = y + D.float() * x[r].float()
                if z is not None:
                    y = y * F.silu(z[r].float())
                out[r] = y.to(out.dtype)

        def selective_scan_fn(u, ssm_states, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                              query_start_loc=None, cache_indices=None, has_initial_state=None,
                              null_block_id=NULL_BLOCK_ID, block_size=1024, block_idx_first_scheduled_token=None,
                              block_idx_last_scheduled_token=None, initial_state_idx=None, cu_chunk_seqlen=None,
                              last_chunk_indices=None):
            # varlen: u/delta/z [dim, tokens], B/C [N, tokens]; the output written into z
            qsl = query_start_loc.tolist()
            for i, (a, b) in enumerate(zip(qsl[:-1], qsl[1:])):
                line = int(cache_indices[i])
                if line == null_block_id:
                    continue
                d = delta[:, a:b].float().t() + delta_bias.float()
                d = _softplus(d) if delta_softplus else d  # [n, dim]
                S0 = ssm_states[line].float() if bool(has_initial_state[i]) else u.new_zeros(A.shape).float()
                decay = torch.cumsum(A[None] * d[:, :, None], dim=0)  # [n, dim, N]: the scan's parallel form
                inputs = (d * u[:, a:b].float().t())[:, :, None] * B[:, a:b].float().t()[:, None, :]
                S = torch.exp(decay) * (S0[None] + torch.cumsum(inputs * torch.exp(-decay), dim=0))
                y = (S * C[:, a:b].float().t()[:, None, :]).sum(-1) + D.float() * u[:, a:b].float().t()
                y = y * F.silu(z[:, a:b].float().t())
                z[:, a:b] = y.t().to(z.dtype)
                ssm_states[line] = S[-1].to(ssm_states.dtype)
            return z
        """,
    "vllm/model_executor/layers/mamba/mamba_mixer.py": """
        import torch

        from vllm.forward_context import get_forward_context
        from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_update
        from vllm.model_executor.layers.mamba.ops.mamba_ssm import selective_scan_fn
        from vllm.model_executor.layers.mamba.ops.ssu_dispatch import selective_state_update

        class MambaMixer:
            # vLLM 0.26's MambaMixer.forward_impl after in_proj, without prefix caching: hidden_states_BC and gate
            # [dim, tokens] (decode tokens first), x_proj [R + 2N, dim] and dt_proj [dim, R] weights, dt_bias,
            # A [dim, N] float32, D; kv_cache = (conv [lines, K-1, dim], ssm [lines, dim, N]). Returns [dim, tokens]
            def ssm_forward(self, hidden_states_BC, gate):
                m = get_forward_context().attn_metadata[self.prefix]
                conv_state, ssm_state = self.kv_cache[0].transpose(-1, -2), self.kv_cache[1]
                nd, npt = m.num_decode_tokens, m.num_prefill_tokens
                hs_d, hs_p = torch.split(hidden_states_BC, [nd, npt], dim=-1)
                gate_d, gate_p = torch.split(gate, [nd, npt], dim=-1)
                R, N = self.R, self.N

                def transform(conv_tm):  # [tokens, dim] -> dt [dim, tokens], B/C [tokens, N]
                    # row by row: the GEMMs' batch dependence is other patches' concern (CPU matmul has one)
                    rows = lambda t, w: torch.stack([r @ w.t() for r in t])  # noqa: E731
                    dt, B, C = rows(conv_tm, self.x_proj).split([R, N, N], dim=-1)
                    return rows(dt, self.dt_proj).t(), B, C

                outs = []
                if npt:
                    conv_p = causal_conv1d_fn(hs_p, self.conv_weights, self.bias, activation="silu",
                                              conv_states=conv_state, has_initial_state=m.has_initial_states_p,
                                              cache_indices=m.state_indices_tensor_p,
                                              query_start_loc=m.query_start_loc_p)
                    dt_p, B_p, C_p = transform(conv_p.t())
                    outs.append(selective_scan_fn(conv_p, ssm_state, dt_p, self.A, B_p.t(), C_p.t(), self.D.float(),
                                                  gate_p, self.dt_bias, delta_softplus=True,
                                                  cache_indices=m.state_indices_tensor_p,
                                                  has_initial_state=m.has_initial_states_p,
                                                  query_start_loc=m.query_start_loc_p))
                if nd:
                    conv_d = causal_conv1d_update(hs_d.t(), conv_state, self.conv_weights, self.bias, "silu",
                                                  conv_state_indices=m.state_indices_tensor_d,
                                                  block_idx_last_scheduled_token=None, initial_state_idx=None).t()
                    dt_d, B_d, C_d = transform(conv_d.t())
                    out_d = torch.empty_like(hs_d.t())
                    selective_state_update(ssm_state, conv_d.t(), dt_d.t(), self.A, B_d, C_d, self.D, self.dt_bias,
                                           z=gate_d.t(), dt_softplus=True,
                                           state_batch_indices=m.state_indices_tensor_d,
                                           dst_state_batch_indices=m.state_indices_tensor_d, out=out_d)
                    outs.insert(0, out_d.t())
                return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        """,
    "vllm/model_executor/layers/mamba/mamba_utils.py": """
        import torch

        class MambaStateDtypeCalculator:  # vLLM 0.26's, for Mamba-2
            @classmethod
            def mamba2_state_dtype(cls, model_dtype, mamba_cache_dtype, mamba_ssm_cache_dtype):
                conv = model_dtype if mamba_cache_dtype == "auto" else getattr(torch, mamba_cache_dtype)
                ssm = conv if mamba_ssm_cache_dtype == "auto" else getattr(torch, mamba_ssm_cache_dtype)
                return (conv, ssm)

        class MambaStateShapeCalculator:
            @classmethod
            def extra_groups_for_head_shards(cls, ngroups, tp_size):
                return 0 if ngroups % tp_size == 0 else tp_size - ngroups

            @classmethod
            def mamba2_state_shape(cls, tp_world_size, intermediate_size, n_groups, num_heads, head_dim,
                                   state_size, conv_kernel, num_spec=0):
                n_groups = n_groups + cls.extra_groups_for_head_shards(n_groups, tp_world_size)
                conv_dim = intermediate_size + 2 * n_groups * state_size
                return ((conv_kernel - 1 + num_spec, conv_dim // tp_world_size),
                        (num_heads // tp_world_size, head_dim, state_size))
        """,
    "vllm/platforms/__init__.py": "",
    "vllm/platforms/interface.py": """
        class Platform:
            @classmethod
            def update_block_size_for_backend(cls, vllm_config):
                # as vLLM 0.26 aligns a hybrid's blocks: the Mamba page from the model class's state sizes
                from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator
                model_cls = vllm_config.model_cls
                shapes = model_cls.get_mamba_state_shape_from_config(vllm_config)
                dtypes = model_cls.get_mamba_state_dtype_from_config(vllm_config)
                vllm_config.mamba_page_bytes = sum(
                    torch_numel(s) * d.itemsize for s, d in zip(shapes, dtypes))

        def torch_numel(shape):
            n = 1
            for d in shape:
                n *= d
            return n
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
    "vllm/v1/worker/__init__.py": "",
    "vllm/v1/worker/gpu_model_runner.py": """
        class GPUModelRunner:
            # vLLM 0.26's V1 runner: each graph size gets num_warmups eager runs (the config's, 0 by default), then
            # one captured run
            def __init__(self, warmups=0):
                import types
                self.compilation_config = types.SimpleNamespace(cudagraph_num_of_warmups=warmups)
                self.runs = []

            def _warmup_and_capture(self, desc, cudagraph_runtime_mode, profile_seq_lens=None,
                                    allow_microbatching=False, num_warmups=None, profiler=None):
                if num_warmups is None:
                    num_warmups = self.compilation_config.cudagraph_num_of_warmups
                self.runs += [(desc, "eager")] * num_warmups + [(desc, cudagraph_runtime_mode)]
        """,
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
    "vllm/model_executor/layers/fused_moe/__init__.py": "",
    "vllm/model_executor/layers/fused_moe/fused_moe.py": """
        def try_get_optimal_moe_config(w1_shape, w2_shape, top_k, dtype, M, block_shape=None):
            # like vLLM's default for block FP8: the M tile (and with it Hopper's swap-AB kernel) follows M
            return {"BLOCK_SIZE_M": 16 if M <= 64 else 64, "BLOCK_SIZE_N": block_shape[0] if block_shape else 64}

        def fused_experts_config(w1_shape, w2_shape, top_k, dtype, M, block_shape):
            return try_get_optimal_moe_config(w1_shape, w2_shape, top_k, dtype, M, block_shape=block_shape)
        """,
    "vllm/model_executor/layers/fused_moe/experts/__init__.py": "",
    "vllm/model_executor/layers/fused_moe/experts/triton_moe.py": """
        from vllm.model_executor.layers.fused_moe.fused_moe import try_get_optimal_moe_config

        def experts_config(w1_shape, w2_shape, top_k, dtype, M, block_shape):
            return try_get_optimal_moe_config(w1_shape, w2_shape, top_k, dtype, M, block_shape=block_shape)
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
