"""A float32 Mamba-2 chunked scan (SSD) for the transformers models tic runs as references (C7's gradients, C2's
stock model), with transformers' `mamba2_chunk_scan` signature and arithmetic, but every contraction an einsum.

Some transformers releases (5.17 among them) write that function's contractions as broadcast products summed
afterwards, which materializes tensors of chunks x positions x positions x heads x state: about 27 GiB for one
4,096-token sequence at NemotronH-8B's mixer shape, before autograd keeps anything. C7 runs the reference on
whole rollout sequences, so tic swaps this version in for the duration of a reference forward (`lean_scans`).
The rounding order may differ from a given release's; the references it serves are compared with tolerances.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn.functional as F

SCAN_NAME = "mamba2_chunk_scan"


def _chunks(t: torch.Tensor, pad: int, chunk: int) -> torch.Tensor:
    """[b, T, ...] -> [b, T / chunk, chunk, ...], zero-padded at the end of T."""
    if pad:
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
    return t.reshape(t.shape[0], -1, chunk, *t.shape[2:])


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """[..., Q] -> [..., Q, Q]: out[i, j] = x[j+1] + ... + x[i] for j <= i, -inf above the diagonal."""
    q = x.shape[-1]
    below = torch.tril(torch.ones(q, q, dtype=torch.bool, device=x.device), diagonal=-1)
    sums = torch.cumsum(x[..., None].expand(*x.shape, q).masked_fill(~below, 0), dim=-2)
    causal = torch.tril(torch.ones(q, q, dtype=torch.bool, device=x.device))
    return sums.masked_fill(~causal, -torch.inf)


def chunk_scan(hidden_states, dt, A, B, C, chunk_size: int, D=None, dt_bias=None, initial_states=None,
               dt_softplus: bool = False, dt_limit=(0.0, float("inf")), return_final_states: bool = False,
               **_unused):
    """x [b, T, H, P], dt [b, T, H], A [H], B and C [b, T, G, N] -> y [b, T, H, P] float32 (and the final state
    [b, H, P, N] when asked): the intra-chunk quadratic form plus the states passed between chunks."""
    b, T, H, P = hidden_states.shape
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(min=dt_limit[0], max=dt_limit[1]).float()
    x = hidden_states.float()
    B = B.float().repeat_interleave(H // B.shape[2], dim=2)
    C = C.float().repeat_interleave(H // C.shape[2], dim=2)
    pad = (chunk_size - T % chunk_size) % chunk_size
    skip = D.float()[:, None] * x if D is not None else None

    xdt, Adt, B, C = (_chunks(t, pad, chunk_size) for t in (x * dt[..., None], A.float() * dt, B, C))
    Adt = Adt.permute(0, 3, 1, 2)  # [b, H, c, l]
    Acum = torch.cumsum(Adt, dim=-1)

    # within a chunk: y_l = sum_{s <= l} (C_l . B_s) exp(Acum_l - Acum_s) dt_s x_s
    decay = torch.exp(_segment_sum(Adt))  # [b, H, c, l, s]
    scores = torch.einsum("bclhn,bcshn->bhcls", C, B) * decay
    y = torch.einsum("bhcls,bcshp->bclhp", scores, xdt)

    # each chunk's own contribution to the state at its end
    to_end = torch.exp(Acum[..., -1:] - Acum)  # [b, H, c, l]
    states = torch.einsum("bclhn,bclhp->bchpn", B * to_end.permute(0, 2, 3, 1)[..., None], xdt)
    start = (initial_states.float()[:, None] if initial_states is not None
             else torch.zeros_like(states[:, :1]))
    states = torch.cat([start, states], dim=1)  # [b, c + 1, H, P, N]
    across = torch.exp(_segment_sum(F.pad(Acum[..., -1], (1, 0))))  # [b, H, c + 1, c + 1]
    states = torch.einsum("bhzc,bchpn->bzhpn", across, states)
    states, final = states[:, :-1], states[:, -1]

    # from each chunk's start state: y_l += (C_l . S_c) exp(Acum_l)
    y = y + torch.einsum("bclhn,bchpn->bclhp", C, states) * torch.exp(Acum).permute(0, 2, 3, 1)[..., None]
    y = y.reshape(b, -1, H, P)[:, :T]
    if skip is not None:
        y = y + skip
    return (y, final) if return_final_states else y


@contextlib.contextmanager
def lean_scans(model: torch.nn.Module):
    """While inside, every modeling module of model's submodules that defines `mamba2_chunk_scan` calls
    `chunk_scan` instead (the name is looked up when the mixer runs). Yields how many modules were switched."""
    modules = {sys.modules.get(type(m).__module__) for m in model.modules()}
    switched = [(mod, getattr(mod, SCAN_NAME)) for mod in modules
                if mod is not None and callable(getattr(mod, SCAN_NAME, None))]
    for mod, _ in switched:
        setattr(mod, SCAN_NAME, chunk_scan)
    try:
        yield len(switched)
    finally:
        for mod, original in switched:
            setattr(mod, SCAN_NAME, original)
