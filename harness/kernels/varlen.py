"""From a padded or packed batch with a block-causal mask to the varlen layout of prefill kernels.

vLLM's prefill attention takes the batch's tokens packed without padding, [N, H, D], with cumulative
sequence starts (cu_seqlens). A training forward holds the same sequences padded (left or right) or packed
into rows; the bool mask HF builds for them says which keys each query sees. This module reads the
sequences back from that mask, checks that it is exactly block-causal (each valid query sees its own
sequence's keys from the start up to itself, or, on a sliding-window layer, the last `window` of them; what padding
queries see does not matter), and gives the gather index and cu_seqlens. Anything else (another window, a custom
mask, a KV cache longer than the queries) is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tic.core.errors import TicInputError


@dataclass
class Varlen:
    index: torch.Tensor  # [N] flat positions (b * T + t) of the valid tokens, in sequence order
    cu_seqlens: torch.Tensor  # int32 [S + 1]
    max_seqlen: int


def _positions(flags: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the True entries of a 1-D bool tensor holding `count` of them, without another device read."""
    try:
        return torch.nonzero_static(flags, size=count).squeeze(1)
    except (NotImplementedError, RuntimeError):  # a backend without nonzero_static
        return flags.nonzero().squeeze(1)


def varlen_from_mask(mask: torch.Tensor | None, batch: int, length: int, device, window: int | None = None) \
        -> Varlen:
    """mask: bool [B, 1, T, T] (True = attend) or None (every row one causal sequence); window: the layer's
    sliding window (each query sees its own sequence's last `window` keys, itself included), None for full."""
    if mask is None:
        index = torch.arange(batch * length, device=device)
        cu = torch.arange(0, (batch + 1) * length, length, device=device, dtype=torch.int32)
        return Varlen(index, cu, length)
    if mask.shape[-1] != mask.shape[-2]:
        raise TicInputError("prefill-style attention needs as many keys as queries (no KV cache); "
                            f"got mask {tuple(mask.shape)}")
    m = mask[:, 0]
    ar = torch.arange(length, device=device)
    valid = m.diagonal(dim1=1, dim2=2)  # a valid token sees itself
    # a sequence starts at a valid token that does not see its predecessor (a window of 1 sees none: every token
    # its own sequence, which computes the same); each token's sequence starts at the last start up to it
    sees_prev = torch.cat([torch.zeros_like(valid[:, :1]), m.diagonal(offset=-1, dim1=1, dim2=2)], dim=1)
    is_start = valid & ~sees_prev
    start = torch.where(is_start, ar[None], 0).cummax(dim=1).values
    keys, queries = ar[None, None, :], ar[None, :, None]
    expected = (keys >= start[..., None]) & (keys <= queries) & valid[..., None]
    if window:
        expected = expected & (queries - keys < window)
    # padding queries (not seeing themselves) may see anything: their outputs are dropped
    rows_ok = ((expected == m) | ~valid[..., None]).all()
    # each sequence's length, at its start: the valid tokens that name that start
    lengths = torch.zeros_like(start).scatter_add_(1, torch.where(valid, start, 0), valid.to(start.dtype))
    # everything the layout needs from the device in one read (a sync each read on GPU)
    ok, n, n_seqs, max_len = torch.stack([rows_ok.to(start.dtype), valid.sum(), is_start.sum(),
                                          lengths.max() if lengths.numel() else start.new_zeros(())]).tolist()
    if not ok:
        raise TicInputError("attention mask is not block-causal over contiguous sequences"
                            + (f" within a sliding window of {window}" if window else "")
                            + " (another window or a custom mask); the varlen prefill kernel cannot reproduce it")
    index = _positions(valid.reshape(-1), n)
    starts = _positions(is_start.reshape(-1)[index], n_seqs)
    cu = torch.cat([starts, torch.tensor([n], device=device)]).to(torch.int32)
    return Varlen(index, cu, max_len)


@dataclass
class PagedLayout:
    """Where each packed token's K/V sits in a paged cache of `block_size` slots per block (as vLLM's KV cache
    holds a sequence): sequences get consecutive blocks in order; slot = block * block_size + offset."""
    slots: torch.Tensor | None  # int64 [N] cache slot of each packed token (None: the pages are the rows)
    block_table: torch.Tensor  # int32 [S, max_blocks] each sequence's blocks (unused entries 0)
    seq_lens: torch.Tensor  # int32 [S] keys per sequence (FlashAttention's seqused_k)
    num_blocks: int
    # > 0: every sequence starts its batch row (right padding), and row b of the padded batch, padded to
    # row_pages pages, is pages b * row_pages ... of the cache: the batch's K/V is the cache, without a scatter
    row_pages: int = 0


def paged_layout(cu_seqlens: torch.Tensor, block_size: int) -> PagedLayout:
    device = cu_seqlens.device
    cu = cu_seqlens.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    nblocks = (lens + block_size - 1) // block_size
    first = torch.cumsum(nblocks, 0) - nblocks  # each sequence's first block
    zero = cu.new_zeros(1)
    n, widest, total = torch.cat([cu[-1:] if cu.numel() else zero, torch.cat([nblocks, zero]).max()[None],
                                  nblocks.sum()[None]]).tolist()  # one device read
    tok = torch.arange(n, device=device)
    seq = torch.searchsorted(cu[1:], tok, right=True)
    pos = tok - cu[seq]
    slots = (first[seq] + pos // block_size) * block_size + pos % block_size
    return PagedLayout(slots, _block_table(first, nblocks, widest), lens.to(torch.int32), max(total, 1))


def _block_table(first: torch.Tensor, nblocks: torch.Tensor, widest: int) -> torch.Tensor:
    """int32 [S, max(widest, 1)]: sequence s's consecutive blocks first[s], first[s] + 1, ... (nblocks[s] of them),
    unused entries 0."""
    cols = torch.arange(max(widest, 1), device=first.device)[None]
    return torch.where(cols < nblocks[:, None], first[:, None] + cols, 0).to(torch.int32)


def paged_rows_layout(vl: Varlen, batch: int, length: int, block_size: int) -> PagedLayout | None:
    """The paged layout in which the padded batch itself is the cache (each row padded to whole pages), when every
    sequence starts at the start of its own row (right padding, one sequence per row); else None. The kernel reads
    each sequence's keys through its block table as from any other pages (FlashAttention: seqused_k keys)."""
    if vl.index.numel() == 0:
        return None
    cu = vl.cu_seqlens.to(torch.int64)
    starts = vl.index[cu[:-1]]
    lens = cu[1:] - cu[:-1]
    nblocks = (lens + block_size - 1) // block_size
    in_rows, widest = torch.stack([(starts % length == 0).all().to(torch.int64), nblocks.max()]).tolist()  # one read
    if not in_rows:
        return None
    row_pages = (length + block_size - 1) // block_size
    table = _block_table(starts // length * row_pages, nblocks, widest)
    return PagedLayout(None, table, lens.to(torch.int32), batch * row_pages, row_pages)
