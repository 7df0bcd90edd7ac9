"""A planted single-step-vs-chunk difference in one Mamba-2 mixer: its decode steps compute the new token's output
with the single-step recurrence (S_t = exp(A dt_t) S_{t-1} + dt_t x_t B_t^T from the chunk's start state) instead of
the chunk arithmetic prefill runs, as an engine whose decode kernel is selective_state_update would. The carried
state stays the kernel's; only the token's output takes the other rounding order. C4 must fail on it, and the
locator must name that mixer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tic.harness.kernels.autograd import Op, Ops
from tic.harness.kernels.mamba import MAMBA_OPS, mamba1_step, mamba_scan_ref


def _single_step_decode(provider, x, dt, B, C, A_log, dt_bias, D, state, buf_x, buf_dt, buf_B, **kw):
    y, carried = provider.mamba_scan(x, dt, B, C, A_log, dt_bias, D, state, buf_x, buf_dt, buf_B, **kw)
    if x.shape[0] == 1 and buf_x.shape[0] > 0:  # a decode step inside a chunk
        with torch.no_grad():
            y = mamba_scan_ref(x, dt, B, C, A_log, dt_bias, D, state, buf_x, buf_dt, buf_B, **kw)[0]
    return y, carried


def _plant(mixer: nn.Module, name: str, forward) -> None:
    """Run operator `name` as `forward` in this one (wrapped) mixer: every other module keeps the model's operators."""
    ops: Ops = mixer._tic_ops
    op = Op(name, forward, MAMBA_OPS[name].reference)
    mixer._tic_ops = Ops(ops.provider, ops.backward, {**ops.table, name: op})


def plant_single_step_decode(mixer: nn.Module) -> None:
    """Install the plant in this one (wrapped) mixer."""
    _plant(mixer, "mamba_scan", _single_step_decode)


def _matmul_decode1(provider, u, dt_raw, B, C, z, A_log, D, dt_bias, state):
    """A Mamba-1 decode step (one token from a carried state) whose output sums C . S as a matrix product, another
    order than the kernel's: as an engine whose decode kernel differs from its prefill scan would."""
    y, carried = provider.mamba1_scan(u, dt_raw, B, C, z, A_log, D, dt_bias, state)
    if u.shape[0] == 1 and bool(state.any()):
        with torch.no_grad():  # the kernel's step for the state, the output summed as (S @ C)
            _, S = mamba1_step(state.float(), u[0], dt_raw[0], B[0], C[0], z[0], -torch.exp(A_log.float()), D,
                                dt_bias)
            y = (((S @ C[0].float()[:, None])[:, 0] + D.float() * u[0].float()) * F.silu(z[0].float()))[None]
            y = y.to(u.dtype)
    return y, carried


def plant_matmul_decode1(mixer: nn.Module) -> None:
    """Install the Mamba-1 plant in this one (wrapped) mixer."""
    _plant(mixer, "mamba1_scan", _matmul_decode1)
