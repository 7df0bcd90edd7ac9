"""Mamba-2 mixer operators: the chunked scan whose decode replays prefill's arithmetic, the causal conv, the gated
grouped RMSNorm; consistent CPU kernels, float32 references and their autograd entries.

The scan (per sequence, per head; A = -exp(A_log), dt = clamp(softplus(dt_raw + dt_bias)), positions split into
chunks of `chunk_size` counted from the sequence's first token):
  token t at offset j of chunk c, from the chunk's start state S_c and the chunk's tokens 0..j:
    y_t = sum_{s<=j} (C_t . B_s) exp(Acum_j - Acum_s) dt_s x_s + (C_t . S_c) exp(Acum_j) + D x_t
  when the chunk's last token arrives: S_{c+1} = exp(Acum_{Q-1}) S_c + sum_s exp(Acum_{Q-1} - Acum_s) dt_s B_s x_s
(Acum = cumulative sum of A dt over the chunk). That is the chunked scan's decomposition (intra-chunk quadratic
form plus the state passed between chunks), not the single-step recurrence S_t = exp(A dt_t) S_{t-1} + ...

Why decode is bitwise prefill: the kernel computes each token from (S_c, the chunk's tokens up to it) with the same
operations on the same shapes whichever phase it runs in. Prefill runs it for every token of a chunk; decode carries
S_c and the current chunk's tokens (x, B, dt_raw) in its state and runs it for the new token; the chunk's end state
is computed once the chunk is full, from the same inputs, by the same function, in either phase. A sequence's chunk
boundaries sit at multiples of chunk_size from its own first token, so padding, packing and batch-mates move none.

The references are an independent float32 implementation: the single-step recurrence over the whole sequence
(mathematically equal, a different rounding order), differentiable; the autograd entries take their gradient
(straight-through: the forward value is the kernel's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tic.harness.kernels.autograd import Op
from tic.harness.kernels.stand_ins import stands_for


# -- consistent CPU kernels ---------------------------------------------------------------------------------------
def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """B or C [.., G, N] repeated to one row per head [.., H, N] (head h reads group h // (H / G))."""
    return t.float().repeat_interleave(heads // t.shape[-2], dim=-2)


def _chunk_decay(dt_raw, A, dt_bias, dt_min: float, dt_max: float):
    """(dt, cumulative A dt) of one chunk's tokens so far [j+1, H], float32."""
    dt = F.softplus(dt_raw.float() + dt_bias.float()).clamp(dt_min, dt_max)
    return dt, torch.cumsum(A[None] * dt, dim=0)


def _token_output(S, xs, Bs, dt, acum, C_t, D):
    """y [H, P] of the chunk's last token so far (offset j) from the chunk's start state S [H, P, N] and its tokens
    0..j: xs [j+1, H, P], Bs [j+1, H, N], dt / acum [j+1, H]; C_t [H, N]."""
    weight = (Bs * C_t[None]).sum(-1) * torch.exp(acum[-1:] - acum) * dt  # [j+1, H]
    y_diag = (weight[..., None] * xs).sum(0)
    y_off = (S * C_t[:, None, :]).sum(-1) * torch.exp(acum[-1])[:, None]
    return y_diag + y_off + D.float()[:, None] * xs[-1]


def _chunk_end_state(S, xs, Bs, dt, acum):
    """S_{c+1} [H, P, N] from S_c and the full chunk's tokens."""
    w = torch.exp(acum[-1:] - acum) * dt  # [Q, H]
    inflow = (w[..., None, None] * xs[..., :, None] * Bs[..., None, :]).sum(0)
    return torch.exp(acum[-1])[:, None, None] * S + inflow


def cpu_mamba_scan(x, dt_raw, B, C, A_log, dt_bias, D, state, buf_x, buf_dt, buf_B, chunk_size: int,
                   dt_min: float, dt_max: float):
    """One sequence's scan (module docstring). x [n, H, P], dt_raw [n, H], B/C [n, G, N]; state [H, P, N] float32
    (the current chunk's start state), buf_* the current chunk's m < chunk_size tokens before x. Returns (y float32
    [n, H, P], the start state of the chunk the sequence ends in)."""
    H = x.shape[1]
    A = -torch.exp(A_log.float())
    xs_all = torch.cat([buf_x.float(), x.float()])
    dts_all = torch.cat([buf_dt, dt_raw])
    Bs_all, Cs = _heads(torch.cat([buf_B, B]), H), _heads(C, H)
    m, S, start, ys = buf_x.shape[0], state.float(), 0, []
    for i in range(x.shape[0]):
        end = m + i + 1  # tokens of the combined stream seen so far; the current chunk is [start, end)
        dt, acum = _chunk_decay(dts_all[start:end], A, dt_bias, dt_min, dt_max)
        ys.append(_token_output(S, xs_all[start:end], Bs_all[start:end], dt, acum, Cs[i], D))
        if end - start == chunk_size:
            S, start = _chunk_end_state(S, xs_all[start:end], Bs_all[start:end], dt, acum), end
    y = torch.stack(ys) if ys else x.new_zeros(x.shape, dtype=torch.float32)
    return y, S


def cpu_mamba_conv(u, window, w, bias):
    """Depthwise causal conv + SiLU of one sequence, token by token over its own window: u [n, C] (the conv's
    inputs), window [K-1, C] (the inputs before u: zeros at a sequence's start, the carried ones in decode),
    w [C, 1, K] (nn.Conv1d's depthwise weight), bias [C] | None -> [n, C] in u's dtype."""
    K = w.shape[-1]
    full = torch.cat([window.to(u.dtype), u])
    rows = []
    for i in range(u.shape[0]):
        rows.append(F.silu(F.conv1d(full[i:i + K].t()[None], w, bias, groups=w.shape[0])[0, :, 0])[None])
        stands_for(u[i:i + 1], rows[-1])  # a window of several tokens: the output row is its newest token's
    return torch.cat(rows) if rows else u.new_zeros(u.shape)


def cpu_gated_rms_norm(y, gate, w, group_size: int, eps: float, out_dtype: torch.dtype):
    """w * rms_norm_grouped(y * silu(gate)) in float32, rounded once to out_dtype; one token row per call."""
    flat_y, flat_g = y.reshape(-1, y.shape[-1]), gate.reshape(-1, gate.shape[-1])

    def one(r, g):
        h = r.float() * F.silu(g.float())
        groups = h.view(-1, group_size)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)
        return (w.float() * groups.view(1, -1)).to(out_dtype)

    rows = [one(r, g) for r, g in zip(flat_y.split(1), flat_g.split(1))]
    out = torch.cat(rows) if rows else flat_y.new_zeros(flat_y.shape, dtype=out_dtype)
    return out.reshape(*y.shape[:-1], y.shape[-1])


def mamba1_step(S, u_t, dt_t, B_t, C_t, z_t, A, D, dt_bias):
    """One token of the selective scan (Mamba-1), float32: dt = softplus(dt_raw + bias) [I];
    S <- exp(dt A) S + (dt u) B^T [I, N]; y = (S C + D u) * silu(z). Returns (y [I], S)."""
    dt = F.softplus(dt_t.float() + dt_bias.float())
    S = torch.exp(dt[:, None] * A) * S + (dt * u_t.float())[:, None] * B_t.float()[None, :]
    y = (S * C_t.float()[None, :]).sum(-1) + D.float() * u_t.float()
    return y * F.silu(z_t.float()), S


def cpu_mamba1_scan(u, dt_raw, B, C, z, A_log, D, dt_bias, state):
    """One sequence's selective scan (Mamba-1, Jamba's mixer without its extra norms), one token after another:
    u / dt_raw / z [n, I] (dt before dt_proj's bias and softplus), B / C [n, N], A_log [I, N], D / dt_bias [I],
    state float32 [I, N] (the state after the tokens before u). Returns (y [n, I] in u's dtype, the state after
    the last token). Each token runs the same operations on the same shapes from the state before it, so a
    decoded token gets the bits it gets in a prefill, in any batch. The float32 steps are the reference's
    (mamba1_scan_ref), rounded once to u's dtype."""
    y, S = mamba1_scan_ref(u, dt_raw, B, C, z, A_log, D, dt_bias, state)
    return y.to(u.dtype), S


class MambaCPUKernels:
    """The Mamba-2 (and Mamba-1 scan) calls of tic's consistent CPU provider (spec.py lists their shapes)."""

    def mamba1_scan(self, u, dt_raw, B, C, z, A_log, D, dt_bias, state):
        return cpu_mamba1_scan(u, dt_raw, B, C, z, A_log, D, dt_bias, state)

    def mamba_conv(self, u, window, w, bias):
        return cpu_mamba_conv(u, window, w, bias)

    def mamba_scan(self, x, dt_raw, B, C, A_log, dt_bias, D, state, buf_x, buf_dt, buf_B, chunk_size, dt_min,
                   dt_max):
        return cpu_mamba_scan(x, dt_raw, B, C, A_log, dt_bias, D, state, buf_x, buf_dt, buf_B, chunk_size,
                              dt_min, dt_max)

    def gated_rms_norm(self, y, gate, w, group_size, eps, out_dtype):
        return cpu_gated_rms_norm(y, gate, w, group_size, eps, out_dtype)


# -- float32 references (differentiable) ----------------------------------------------------------------------------
def mamba_conv_ref(u, window, w, bias):
    full = torch.cat([window.float(), u.float()]).t()[None]
    out = F.conv1d(full, w.float(), None if bias is None else bias.float(), groups=w.shape[0])
    return F.silu(out[0].t())


def mamba_scan_ref(x, dt_raw, B, C, A_log, dt_bias, D, state, buf_x, buf_dt, buf_B, chunk_size, dt_min, dt_max):
    """The single-step recurrence S_t = exp(A dt_t) S_{t-1} + dt_t x_t B_t^T, y_t = S_t C_t + D x_t, from the
    buffered tokens on; the returned state is S at the last chunk boundary, as the kernel's."""
    H = x.shape[1]
    A = -torch.exp(A_log.float())
    xs = torch.cat([buf_x.float(), x.float()])
    dt = F.softplus(torch.cat([buf_dt, dt_raw]).float() + dt_bias.float()).clamp(dt_min, dt_max)
    Bs, Cs = _heads(torch.cat([buf_B, B]), H), _heads(C, H)
    m, S, ys = buf_x.shape[0], state.float(), []
    boundary = (m + x.shape[0]) // chunk_size * chunk_size
    at_boundary = S
    for t in range(xs.shape[0]):
        S = torch.exp(A * dt[t])[:, None, None] * S + (dt[t][:, None] * xs[t])[..., None] * Bs[t][:, None, :]
        if t >= m:
            ys.append((S * Cs[t - m][:, None, :]).sum(-1) + D.float()[:, None] * xs[t])
        if t + 1 == boundary:
            at_boundary = S
    y = torch.stack(ys) if ys else xs.new_zeros(x.shape)
    return y, at_boundary


def gated_rms_norm_ref(y, gate, w, group_size, eps, out_dtype):
    h = y.float() * F.silu(gate.float())
    groups = h.reshape(*h.shape[:-1], -1, group_size)
    groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)
    return w.float() * groups.reshape(h.shape)


def mamba1_scan_ref(u, dt_raw, B, C, z, A_log, D, dt_bias, state):
    """The selective scan step by step in float32, differentiable (memory: a state per token, n x I x N)."""
    A = -torch.exp(A_log.float())
    S, ys = state.float(), []
    for t in range(u.shape[0]):
        y, S = mamba1_step(S, u[t], dt_raw[t], B[t], C[t], z[t], A, D, dt_bias)
        ys.append(y)
    return (torch.stack(ys) if ys else u.new_zeros(u.shape, dtype=torch.float32)), S


# -- autograd entries (tic.harness.kernels.autograd.Op): forward the provider's kernel, backward the reference's ----
MAMBA_OPS: dict[str, Op] = {op.name: op for op in [
    Op("mamba_conv", lambda p, u, window, w, b: p.mamba_conv(u, window, w, b), mamba_conv_ref),
    Op("mamba_scan", lambda p, *t, **kw: p.mamba_scan(*t, **kw), mamba_scan_ref),
    Op("mamba1_scan", lambda p, *t: p.mamba1_scan(*t), mamba1_scan_ref),
    Op("gated_rms_norm", lambda p, y, g, w, **kw: p.gated_rms_norm(y, g, w, **kw), gated_rms_norm_ref),
]}
