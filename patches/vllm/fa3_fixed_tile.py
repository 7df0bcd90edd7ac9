"""FlashAttention 3 with one tile for decode, prefill and mixed batches.

vLLM's FA3 backend passes the batch's longest query (`max_seqlen_q`) to the kernel, whose heuristics pick the
query/key tile from it: a decode step (one query row per sequence) runs another tile, so another accumulation
order over the keys, than the prefill that scores the same rows. Measured on the H200 with vLLM 0.26.0
(head_dim 64, paged KV, 400 tokens): 272 of 400 decode rows differed from prefill; with `max_seqlen_q` raised
to at least 128 for every call, 0 of 400 (also a decode row inside a mixed batch). The kernel itself is kept;
only its launch is pinned. The split count grows with the batch under CUDA graphs, so it is fixed to one, in the
launch and in the backend's ahead-of-time plan; a launch whose max_seqlen_q was raised runs without the plan (it
was made for the unraised one). Cascade
attention (a shared-prefix fast path with another reduction) is switched off for the same reason.

A sliding-window launch needs more: there a row's bits follow which other query rows share its tile (measured on
an H100, vLLM 0.26.0, head_dim 64-256, windows 31-1023, benchmarks/gpu/fa3_window_probe.py: decode rows differ from
the prefill's once the window's left edge passes key 0, at every max_seqlen_q, and a chunked prefill agrees with
the whole one only where its query tiles start at the same rows). A decode step holds each row alone in its tile,
so every windowed call with more than one query row per sequence is launched the same way: each query row as a
sequence of its own, with the keys up to its position (its sequence's block table, its causal key count). Decode,
prefill, mixed batches and a training forward then compute each row alike. It costs prefill speed on windowed
layers (one partly filled tile per row).

The max_seqlen_q pin is not needed everywhere: on the H100 decode rows at vLLM's own max_seqlen_q = 1 equal the
prefill's with head_dim 128 and 256, and differ with head_dim 64 (fa3_window_probe.py). It costs decode speed (four
query tiles launched per sequence where one holds its rows). So a causal, paged call (bf16/fp16, or FP8 with its
scales) keeps its own max_seqlen_q once a check on a seeded sequence in a cache shaped like the call's showed that
launches of 1 to 127 query rows per sequence give the pinned prefill's bits (`natural_launch_agrees`, once per
shape in the process); every other call, and any call while a CUDA graph is captured before its shape was checked,
is pinned. So that decode graphs are captured after the check, each graph size runs once eagerly first (vLLM's V1
runner skips that by default; _decided.py).
"""

from __future__ import annotations

import functools

from tic.patches._swap import swap_hooks
from tic.patches.base import Patch
from tic.patches.vllm._decided import counts, decided, with_eager_run_before_capture

NAME = "fa3-fixed-tile"
MIN_TILE_Q = 128  # a max_seqlen_q at or above this selects FA3's prefill tile (measured: decode = prefill)
_BACKEND = "vllm.v1.attention.backends.flash_attn"


def _sliding(window_size) -> bool:
    return window_size is not None and int(window_size[0]) >= 0


def rows_apart(kwargs: dict) -> dict:
    """The keywords of a paged varlen call with every query row made a sequence of its own: one query, its
    sequence's block table, the keys up to its position (rows past the last sequence get no keys)."""
    import torch

    q, cu, used, table = kwargs["q"], kwargs["cu_seqlens_q"], kwargs["seqused_k"], kwargs["block_table"]
    rows = torch.arange(q.shape[0], device=cu.device, dtype=cu.dtype)
    seq = (torch.searchsorted(cu, rows, right=True) - 1).clamp_(0, cu.numel() - 2)
    keys = used[seq] - (cu[seq + 1] - 1 - rows).to(used.dtype)
    keys = torch.where(rows < cu[-1], keys, torch.zeros_like(keys))
    return {**kwargs, "cu_seqlens_q": torch.arange(q.shape[0] + 1, device=cu.device, dtype=cu.dtype),
            "seqused_k": keys, "block_table": table.index_select(0, seq.long()), "max_seqlen_q": MIN_TILE_Q}


CHECK_TOKENS = 2048  # the seeded sequence the natural launch is checked on
# rows per sequence of the launches checked (1: decode), dense enough that a launch heuristic's threshold on
# max_seqlen_q between them would show
CHECK_QUERY_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, MIN_TILE_Q - 1)
_natural_ok: dict = {}


DESCALES = ("q_descale", "k_descale", "v_descale")  # FP8 inputs' scales, one per (sequence, KV head)


def _checkable(kw: dict) -> bool:
    """A causal call on a paged cache (bf16/fp16, or FP8 with its three descales) with no sinks or extra inputs:
    one the check rebuilds. vLLM's backend hands over the K and V descales with a 16-bit cache too (FA3 reads them
    for FP8 inputs only); the check launches with them as the call does, so they do not stop it."""
    import torch

    q, k = kw.get("q"), kw.get("k")
    if q is None or k is None or k.dtype != q.dtype:
        return False
    fp8 = q.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    return (q.dtype in (torch.bfloat16, torch.float16) or (fp8 and all(kw.get(n) is not None for n in DESCALES))) \
        and bool(kw.get("causal")) and kw.get("block_table") is not None and kw.get("seqused_k") is not None \
        and not _sliding(kw.get("window_size")) and all(kw.get(n) is None for n in ("s_aux", "q_v", "alibi_slopes"))


def checks() -> dict:
    """The natural-launch checks this process ran: attention shapes that keep their own launch, pinned ones."""
    return counts(_natural_ok, "natural_launch_shapes", "pinned_shapes")


def natural_launch_agrees(fn, kw: dict) -> bool:
    """Whether this call's attention shape gives the pinned launch's bits at any max_seqlen_q below the pin."""
    if not _checkable(kw):
        return False
    q, k, v = kw["q"], kw["k"], kw["v"]
    key = (q.dtype, tuple(q.shape[-2:]), tuple(k.shape[1:]), v.shape[-1], float(kw.get("softcap") or 0.0),
           kw.get("fa_version"), kw.get("softmax_scale"), q.device)
    return decided(_natural_ok, key, lambda: _check_natural_launch(fn, kw), q.is_cuda, False)


def _check_natural_launch(fn, kw: dict) -> bool:
    """One seeded CHECK_TOKENS-token sequence in a cache shaped like the call's: its pinned prefill against launches
    that split it into sequences of r query rows (each over the same pages, keys up to its last row), each launched
    with max_seqlen_q = r, as decode (r = 1) and short chunks are."""
    import torch

    q0, k0, v0, table0 = kw["q"], kw["k"], kw["v"], kw["block_table"]
    n, page, dev = CHECK_TOKENS, k0.shape[1], q0.device
    pages = -(-n // page)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(n, *q0.shape[1:], generator=g, device=dev).to(q0.dtype)
    k = torch.randn(pages, *k0.shape[1:], generator=g, device=dev).to(k0.dtype)
    v = torch.randn(pages, *v0.shape[1:], generator=g, device=dev).to(v0.dtype)
    row = torch.arange(pages, device=dev, dtype=table0.dtype)
    index = kw["seqused_k"].dtype

    def launch(r: int, max_q: int):
        ends = list(range(r, n, r)) + [n]
        cu = torch.tensor([0] + ends, device=dev, dtype=kw["cu_seqlens_q"].dtype)
        # an FP8 call's scales: the call's first, for every (sequence, KV head) of these launches
        scales = {d: kw[d].reshape(-1)[:1].expand(len(ends), k.shape[2]) for d in DESCALES if kw.get(d) is not None}
        out = fn(**{**kw, **scales, "q": q, "k": k, "v": v, "out": None, "cu_seqlens_q": cu, "max_seqlen_q": max_q,
                    "seqused_k": torch.tensor(ends, device=dev, dtype=index), "max_seqlen_k": n,
                    "block_table": row.expand(len(ends), pages).contiguous(), "scheduler_metadata": None,
                    "num_splits": 1})
        return out[0] if isinstance(out, tuple) else out

    pinned = launch(n, max(n, MIN_TILE_Q))
    return all(torch.equal(launch(r, r), pinned) for r in CHECK_QUERY_ROWS)


def _pin(fn):
    @functools.wraps(fn)
    def pinned(*args, **kwargs):
        if "max_seqlen_q" in kwargs:
            natural = int(kwargs["max_seqlen_q"])
            plan = kwargs.get("scheduler_metadata")
            kwargs["scheduler_metadata"] = None
            kwargs["num_splits"] = 1
            if not natural_launch_agrees(fn, kwargs):
                kwargs["max_seqlen_q"] = max(natural, MIN_TILE_Q)
            if natural > 1 and _sliding(kwargs.get("window_size")) and kwargs.get("block_table") is not None \
                    and kwargs.get("seqused_k") is not None and "q" in kwargs:
                kwargs = rows_apart(kwargs)
            elif kwargs["max_seqlen_q"] == natural:
                # the step's plan (one split, see _one_split) fits a launch left as the builder saw it; it only
                # orders the tiles, so the kernel need not plan again in every layer
                kwargs["scheduler_metadata"] = plan
        return fn(*args, **kwargs)
    return pinned


def _one_split(fn):
    """The backend's ahead-of-time plan, made for the one split every launch here runs."""
    @functools.wraps(fn)
    def planned(*args, **kwargs):
        return fn(*args, **{**kwargs, "num_splits": 1})
    return planned


def _never(fn):
    @functools.wraps(fn)
    def never(*args, **kwargs):
        return False
    return never


PATCH = Patch(
    name=NAME, target="vllm", versions=">=0.26.0,<0.27", gate="C4",
    symptom="C4 (or C3) fails in self_attn.attn, first operator _vllm_fa3_C.fwd: one decode row vs the same "
            "sequence's prefill rows differ (often 1 ulp) once the context passes ~128 keys; on a sliding-window "
            "layer (window_size_left set) once the window's left edge passes key 0",
    fix="every FA3 varlen call is launched with one split (the backend's AOT scheduler plan too), and with "
        "max_seqlen_q >= 128 (then without the plan) unless a check in the process showed its attention shape "
        "gives those bits at its own max_seqlen_q, so decode, prefill and mixed batches run one key order; a "
        "windowed call with several query rows per sequence runs each row as a sequence of its own, as decode "
        "does; cascade attention is off",
    guide="guides/C4.md",
    cost="the three patches together: 118-119 % of default vLLM's tokens/s on a Qwen3-1.7B-like model with CUDA "
         "graphs (H200, vLLM 0.26.0, docs/results/vllm-patches.md); this wrapper alone measured 96.6 % earlier; "
         "on windowed layers prefill runs one partly filled tile per row (not measured)",
    **with_eager_run_before_capture(NAME, swap_hooks(NAME, (_BACKEND, "flash_attn_varlen_func", _pin, _BACKEND),
                                                     (_BACKEND, "get_scheduler_metadata", _one_split, _BACKEND),
                                                     (_BACKEND, "use_cascade_attention", _never, _BACKEND))),
    _choices=checks,
)
