"""A planted single-step-vs-chunk difference in one Mamba-2 mixer: its decode steps compute the new token's output
with the single-step recurrence (S_t = exp(A dt_t) S_{t-1} + dt_t x_t B_t^T from the chunk's start state) instead of
the chunk arithmetic prefill runs, as an engine whose decode kernel is selective_state_update would. The carried
state stays the kernel's; only the token's output takes the other rounding order. C4 must fail on it, and the
locator must name that mixer.
"""

from __future__ import annotations

import torch
from torch import nn

from tic.harness.kernels.autograd import Op, Ops
from tic.harness.kernels.mamba import MAMBA_OPS, mamba_scan_ref


def _single_step_decode(provider, x, dt, B, C, A_log, dt_bias, D, state, buf_x, buf_dt, buf_B, **kw):
    y, carried = provider.mamba_scan(x, dt, B, C, A_log, dt_bias, D, state, buf_x, buf_dt, buf_B, **kw)
    if x.shape[0] == 1 and buf_x.shape[0] > 0:  # a decode step inside a chunk
        with torch.no_grad():
            y = mamba_scan_ref(x, dt, B, C, A_log, dt_bias, D, state, buf_x, buf_dt, buf_B, **kw)[0]
    return y, carried


def plant_single_step_decode(mixer: nn.Module) -> None:
    """Install the plant in this one (wrapped) mixer: every other module keeps the model's operators."""
    ops: Ops = mixer._tic_ops
    op = Op("mamba_scan", _single_step_decode, MAMBA_OPS["mamba_scan"].reference)
    mixer._tic_ops = Ops(ops.provider, ops.backward, {**ops.table, "mamba_scan": op})
