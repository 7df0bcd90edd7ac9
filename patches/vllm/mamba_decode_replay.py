"""Mamba-2 decode that replays the current chunk through the prefill's chunked scan (eager rollouts).

vLLM 0.26 decodes a MambaMixer2 by the single-step update (`selective_state_update`: S <- exp(A dt) S + dt B x,
y = C S + D x), a different rounding order from the chunked scan (`mamba_chunk_scan_combined_varlen`) that
prefills the same tokens, so a decoded token's logprob differs from the same token prefilled (C4) and from the
training forward (C5). This patch keeps, per request and mixer, the start state of the current chunk (in vLLM's
own `ssm_state` slot) and the chunk's tokens so far (x, raw dt, B: a third state of the slot), and computes each
decoded token with the chunked scan over those tokens plus the new one, from that start state; a full chunk's end
state replaces the start state. A prefill stores the same (the start state of the chunk each sequence ends in,
and its partial chunk), and a chunked-prefill continuation prepends the buffered tokens, so chunk boundaries sit
at multiples of chunk_size from each sequence's first token whatever the scheduler's steps. The decode conv runs
the prefill's `causal_conv1d_fn` over the new token and the carried window instead of `causal_conv1d_update`.

Exact if the chunked scan gives a token's row from its chunk's start state and the chunk's tokens up to it alone
(benchmarks/gpu/mamba_replay_probe.py measures that on vLLM's kernels). The decode step keeps its state (buffers,
counts, lengths) on the device and pads each request's chunk to chunk_size tokens, so its shapes follow the batch
alone and nothing is read back to the host: a CUDA graph can hold it (measured eager and with full CUDA graphs of
the decode steps without torch.compile, the two modes C0 accepts). Prefill runs eagerly and reads the counts once
per step. Prefix caching (mamba_cache_mode align or all; C0 refuses it) and speculative decoding stop the mixer
with the reason. Cost: a decode step scans chunk_size tokens per request once (a first chunk's rows from a zero
start state); the buffers take chunk_size x (H x P + H + G x N) elements of the model's dtype per state slot and
mixer. They are a third state in the mixer's cache spec (the state calculators add it while a MambaMixer2 builds
its spec or vLLM's block-size alignment sizes the states; the mixer's get_state_shape/get_state_dtype alone keep
two), so vLLM's memory sizing counts them and the attention blocks are aligned to the larger page.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

from tic.patches._swap import swap_hooks
from tic.patches.base import Patch

NAME = "mamba-decode-replay"
_MIXER = "vllm.model_executor.layers.mamba.mamba_mixer2"
_UTILS = "vllm.model_executor.layers.mamba.mamba_utils"
_PLATFORM = "vllm.platforms.interface"
_LAYER: list = []  # the mixer whose conv_ssm_forward runs now (the kernels' wrappers read its state)


@dataclass
class _Chunks:
    """One mixer's replay state per ssm_state slot, on the device (a decode step replayed from a CUDA graph updates
    it without the host): the current chunk's tokens (x, raw dt, B), how many it holds, the sequence's length."""
    x: object
    dt: object
    B: object
    count: object   # int32 [slots]
    length: object  # int64 [slots]
    buffer: object  # the cache's chunk-buffer state the three views above share


def _chunks(layer, x, dt, B) -> _Chunks:
    """The mixer's chunk buffers: views of the third state vLLM allocated in its cache for this patch (per slot
    [chunk_size, H x P + H + G x N], counted in vLLM's memory like the conv and SSM states), and per slot the count
    and length (small tensors of the mixer's own)."""
    import torch

    cache = layer.kv_cache
    if len(cache) < 3:
        raise RuntimeError(f"patch {NAME}: the mixer's cache has no chunk buffer; the patch must be active before "
                           "vLLM sizes its cache (its plugin entry point, or tic.patches.apply before LLM(...))")
    buffer, slots = cache[2], cache[1].shape[0]
    store = getattr(layer, "_tic_chunks", None)
    if store is None or store.buffer.data_ptr() != buffer.data_ptr() or store.x.shape[0] != slots:
        hp, h = x.shape[1] * x.shape[2], dt.shape[1]
        store = layer._tic_chunks = _Chunks(
            buffer[..., :hp].unflatten(-1, tuple(x.shape[1:])), buffer[..., hp:hp + h],
            buffer[..., hp + h:].unflatten(-1, tuple(B.shape[1:])),
            torch.zeros(slots, dtype=torch.int32, device=x.device),
            torch.zeros(slots, dtype=torch.int64, device=x.device), buffer)
    return store


def chunk_buffer_shape(chunk_size: int, heads: int, head_dim: int, groups: int, state_size: int) -> tuple[int, int]:
    """Per state slot: chunk_size tokens of x (heads x head_dim), raw dt (heads) and B (groups x state_size)."""
    return chunk_size, heads * head_dim + heads + groups * state_size


_CHUNK: list = []  # the chunk size while vLLM sizes a MambaMixer2's states (the calculators then add the buffer)


def _sizing(chunk_of):
    """make(original) for a method that sizes Mamba states: the calculators it reaches add the chunk buffer for
    chunk_of(self or cls, *args) (None: they do not)."""
    def make(original):
        @functools.wraps(original)
        def sized(owner, *args, **kw):
            q = chunk_of(owner, *args, **kw)
            if not q:
                return original(owner, *args, **kw)
            _CHUNK.append(int(q))
            try:
                return original(owner, *args, **kw)
            finally:
                _CHUNK.pop()
        return sized
    return make


def _layer_chunk(layer, *args, **kw):
    return layer.model_config.get_mamba_chunk_size()


def _config_chunk(cls, vllm_config, *args, **kw):
    model_config = getattr(vllm_config, "model_config", None)
    return model_config.get_mamba_chunk_size() if model_config is not None else None


def _shape_with_buffer(original):
    @functools.wraps(original)
    def mamba2_state_shape(cls, *args, **kw):
        shapes = original(cls, *args, **kw)
        if not _CHUNK:
            return shapes
        a = inspect.signature(original).bind(cls, *args, **kw).arguments
        tp, groups = a["tp_world_size"], a["n_groups"]
        groups += cls.extra_groups_for_head_shards(groups, tp)
        return (*shapes, chunk_buffer_shape(_CHUNK[-1], a["num_heads"] // tp, a["head_dim"], groups // tp,
                                            a["state_size"]))
    return mamba2_state_shape


def _dtype_with_buffer(original):
    @functools.wraps(original)
    def mamba2_state_dtype(cls, model_dtype, mamba_cache_dtype, mamba_ssm_cache_dtype):
        dtypes = original(cls, model_dtype, mamba_cache_dtype, mamba_ssm_cache_dtype)
        if not _CHUNK:
            return dtypes
        return (*dtypes, original(cls, model_dtype, "auto", "auto")[0])  # the activations' dtype: the model's
    return mamba2_state_dtype


def _streams(lengths: list[int], Q: int):
    """Varlen chunk metadata for streams that each start at a chunk boundary: (cu_seqlens, cu_chunk_seqlens,
    last_chunk_indices, seq_idx) as lists; chunks cut at multiples of Q from each stream's start."""
    cu, chunks, last, seq = [0], [0], [], []
    for b, n in enumerate(lengths):
        for start in range(0, n, Q):
            chunks.append(chunks[-1] + min(Q, n - start))
            seq.append(b)
        last.append(len(seq) - 1)
        cu.append(cu[-1] + n)
    return cu, chunks, last, seq


def _scan(original, x, dt, A, B, C, Q, lengths, starts, D, dt_bias, state_dtype, dt_limit):
    """The chunked scan over streams (each from a chunk boundary; starts: per stream its start state or None);
    returns (out [tokens, H, P], per-chunk end states, stream metadata)."""
    import torch

    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=x.device)  # noqa: E731
    cu, chunks, last, seq = _streams(lengths, Q)
    init = None
    if any(s is not None for s in starts):
        zero = torch.zeros(x.shape[1], x.shape[2], B.shape[2], dtype=state_dtype, device=x.device)
        init = torch.stack([zero if s is None else s.to(state_dtype) for s in starts])
    out = torch.empty_like(x)
    states = original(x, dt, A, B, C, chunk_size=Q, cu_seqlens=i32(cu), cu_chunk_seqlens=i32(chunks),
                      last_chunk_indices=i32(last), seq_idx=i32(seq), out=out, D=D, z=None, dt_bias=dt_bias,
                      initial_states=init, dt_softplus=True, dt_limit=dt_limit, return_intermediate_states=True,
                      state_dtype=state_dtype)
    return out, states, (cu, last)


def _keep(store, slot, ssm_state, start, states, last_chunk, first_chunk, n, total, xs, dts, Bs) -> None:
    """After a stream of n tokens (ending its sequence at `total` tokens): the start state of the chunk the
    sequence ends in into the slot, the partial chunk's tokens into the buffer."""
    Q = store.x.shape[1]
    if n % Q == 0:
        ssm_state[slot] = states[last_chunk]
    elif last_chunk > first_chunk:
        ssm_state[slot] = states[last_chunk - 1]
    elif start is not None:
        ssm_state[slot] = start
    else:
        ssm_state[slot] = 0
    r = n % Q
    store.count[slot], store.length[slot] = r, total
    if r:
        store.x[slot, :r], store.dt[slot, :r], store.B[slot, :r] = xs[n - r:n], dts[n - r:n], Bs[n - r:n]


def _replay_prefill(original):
    @functools.wraps(original)
    def scan(x, dt, A, B, C, chunk_size, cu_seqlens, cu_chunk_seqlens, last_chunk_indices, seq_idx, out, D=None,
             z=None, dt_bias=None, initial_states=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
             return_intermediate_states=False, state_dtype=None):
        meta = _metadata()
        if meta is None or z is not None or not dt_softplus or return_intermediate_states:
            return original(x, dt, A, B, C, chunk_size, cu_seqlens, cu_chunk_seqlens, last_chunk_indices, seq_idx,
                            out, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states, dt_softplus=dt_softplus,
                            dt_limit=dt_limit, return_intermediate_states=return_intermediate_states,
                            state_dtype=state_dtype)
        import torch

        layer, Q = _LAYER[-1], int(chunk_size)
        layer._tic_chunk_size = Q
        ssm_state, store = layer.kv_cache[1], _chunks(layer, x, dt, B)
        slots = [int(s) for s in meta.state_indices_tensor_p.reshape(-1).tolist()]
        cont = meta.has_initial_states_p.tolist() if meta.has_initial_states_p is not None else [False] * len(slots)
        qsl = cu_seqlens.tolist()
        counts, held = store.count.tolist(), store.length.tolist()  # prefill runs eagerly: read once on the host
        pieces, lengths, starts = [], [], []
        for i, slot in enumerate(slots):
            m = counts[slot] if cont[i] else 0
            a, b = qsl[i], qsl[i + 1]
            C0 = C.new_zeros(m, *C.shape[1:])  # a buffered token's C reaches its own row alone
            held_x, held_dt, held_B = (t[slot, :m].to(v.dtype) for t, v in ((store.x, x), (store.dt, dt),
                                                                              (store.B, B)))
            pieces.append((torch.cat([held_x, x[a:b]]), torch.cat([held_dt, dt[a:b]]),
                           torch.cat([held_B, B[a:b]]), torch.cat([C0, C[a:b]]), m))
            lengths.append(m + b - a)
            chunk_start = held[slot] - m if cont[i] else 0
            starts.append(ssm_state[slot].clone() if cont[i] and chunk_start > 0 else None)
        xs, dts, Bs, Cs = (torch.cat([p[k] for p in pieces]) for k in range(4))
        full, states, (cu, last) = _scan(original, xs, dts, A, Bs, Cs, Q, lengths, starts, D, dt_bias,
                                         state_dtype or C.dtype, dt_limit)
        kept = []
        for i, slot in enumerate(slots):
            m, (a, b) = pieces[i][4], (qsl[i], qsl[i + 1])
            out[a:b] = full[cu[i] + m:cu[i + 1]]
            first = last[i - 1] + 1 if i else 0
            before = held[slot] - m if cont[i] else 0
            _keep(store, slot, ssm_state, starts[i], states, last[i], first, lengths[i], before + lengths[i],
                  xs[cu[i]:cu[i + 1]], dts[cu[i]:cu[i + 1]], Bs[cu[i]:cu[i + 1]])
            kept.append(ssm_state[slot].clone())
        return torch.stack(kept)  # the mixer writes these into ssm_state[state_indices_tensor_p]: the same values
    return scan


def _replay_decode(original):
    @functools.wraps(original)
    def update(state, x, dt, A, B, C, D, dt_bias, z=None, dt_softplus=False, state_batch_indices=None,
               dst_state_batch_indices=None, out=None, num_accepted_tokens=None, cu_seqlens=None, **kw):
        from vllm.model_executor.layers.mamba.ops.ssd_combined import mamba_chunk_scan_combined_varlen as scan

        layer = _LAYER[-1] if _LAYER else None
        if layer is None or z is not None or not dt_softplus or num_accepted_tokens is not None:
            raise RuntimeError(f"patch {NAME}: a Mamba-2 decode outside MambaMixer2's plain path (gate z, no "
                               "softplus or speculative tokens) is not covered")
        Q = int(getattr(layer, "_tic_chunk_size", 0) or layer.model_config.get_mamba_chunk_size())
        layer._tic_chunk_size = Q
        raw_dt = dt[..., 0]
        store = _chunks(layer, x, raw_dt, B)
        slots = state_batch_indices.reshape(x.shape[0], -1)[:, 0]
        _decode_step(scan, store, state, slots, x, raw_dt, A[:, 0, 0], B, C, D[:, 0], dt_bias[:, 0], out, Q)
    return update


def _decode_step(scan, store, state, slots, x, raw_dt, A, B, C, D, dt_bias, out, Q: int) -> None:
    """One decode token per row, all on the device with shapes fixed by the batch (a CUDA graph can hold it): each
    row's stream is its chunk's buffered tokens, then the new token, then zeros up to Q tokens (a row's value
    depends on the rows before it only, so the padding after it changes nothing of it). One scan serves every row:
    from the slot's start state, or from zeros for a sequence still in its first chunk, which its prefill scanned
    without a start state (vLLM's kernels read a missing start state as zeros: the chunk scan's tl.zeros, the state
    passing's exp(dA) * 0 + state, so the bits agree). A token that fills its chunk makes the chunk's end state the
    slot's start state. Rows with a negative slot (padding) write nothing."""
    import torch

    n, dev = x.shape[0], x.device
    real = slots >= 0
    s = slots.clamp(min=0).long()
    count, length = store.count[s].long(), store.length[s]
    pos = torch.arange(Q, device=dev)
    new_at, held = pos[None] == count[:, None], pos[None] < count[:, None]

    def stream(buffer, token):
        shape = (n, Q) + (1,) * (token.dim() - 1)
        zero = torch.zeros((), dtype=token.dtype, device=dev)
        own = torch.where(held.view(shape), buffer[s].to(token.dtype), zero)
        return torch.where(new_at.view(shape), token[:, None], own).flatten(0, 1)

    xs, dts, Bs = stream(store.x, x), stream(store.dt, raw_dt), stream(store.B, B)
    Cs = torch.where(new_at.view(n, Q, 1, 1), C[:, None], torch.zeros((), dtype=C.dtype, device=dev)).flatten(0, 1)
    bounds = (torch.arange(n + 1, device=dev) * Q).to(torch.int32)
    rows = torch.arange(n, device=dev, dtype=torch.int32)
    meta = dict(chunk_size=Q, cu_seqlens=bounds, cu_chunk_seqlens=bounds, last_chunk_indices=rows, seq_idx=rows,
                D=D, z=None, dt_bias=dt_bias, dt_softplus=True, dt_limit=(0.0, float("inf")),
                return_intermediate_states=True, state_dtype=state.dtype)
    col = (n, 1, 1, 1)
    start = torch.where((length < Q).view(col), torch.zeros((), dtype=state.dtype, device=dev), state[s])
    y = torch.empty_like(xs)
    end = scan(xs, dts, A, Bs, Cs, out=y, initial_states=start, **meta)
    at = torch.arange(n, device=dev) * Q + count
    out[:n] = torch.where(real[:, None, None], y[at].to(out.dtype), out[:n])

    kept = torch.where((count + 1 == Q).view(col), end.to(state.dtype), start)
    state[s] = torch.where(real.view(col), kept, state[s])
    for buffer, token in ((store.x, x), (store.dt, raw_dt), (store.B, B)):
        keep = real.view((n,) + (1,) * (token.dim() - 1))
        buffer[s, count] = torch.where(keep, token.to(buffer.dtype), buffer[s, count])
    store.count[s] = torch.where(real, (count + 1) % Q, count).to(store.count.dtype)
    store.length[s] = torch.where(real, length + 1, length)


def conv_as_prefill(original):
    @functools.wraps(original)
    def conv_update(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None, **kw):
        import torch
        from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn

        if x.dim() != 2 or kw.get("num_accepted_tokens") is not None:
            return original(x, conv_state, weight, bias, activation, conv_state_indices, **kw)
        n = x.shape[0]
        idx = conv_state_indices.reshape(n, -1)[:, 0].contiguous()
        extra = {} if (meta := _conv_metadata(n, x.device)) is None else {"metadata": meta}
        out = causal_conv1d_fn(x.transpose(0, 1), weight, bias, conv_states=conv_state,
                               query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=x.device),
                               cache_indices=idx, has_initial_state=torch.ones(n, dtype=torch.bool, device=x.device),
                               activation=activation, **extra)
        return out.transpose(0, 1)
    return conv_update


_CONV_METADATA: dict = {}


def _conv_metadata(n: int, device):
    """causal_conv1d_fn's launch metadata for n one-token sequences, built once per n and kept (a CUDA graph replays
    the copies it was built with): given it, the kernel does not read the sequence lengths back to the host, which
    a captured decode step cannot do. None where this vLLM has no builder for it."""
    key = (n, str(device))
    if key not in _CONV_METADATA:
        try:
            from vllm.v1.attention.backends.utils import compute_causal_conv1d_metadata
        except ImportError:
            _CONV_METADATA[key] = None
        else:
            import torch
            from types import SimpleNamespace

            nums, batch_ptr, offsets = compute_causal_conv1d_metadata(torch.arange(n + 1, dtype=torch.int32),
                                                                      device=device)
            _CONV_METADATA[key] = SimpleNamespace(nums_dict=nums, batch_ptr=batch_ptr,
                                                  token_chunk_offset_ptr=offsets)
    return _CONV_METADATA[key]


def _metadata():
    """The running mixer's Mamba2 metadata, or None outside a model step (profile run, warm-up)."""
    if not _LAYER:
        return None
    from vllm.forward_context import get_forward_context

    meta = get_forward_context().attn_metadata
    return None if meta is None else meta[_LAYER[-1].prefix]


def _tracking(original):
    @functools.wraps(original)
    def conv_ssm_forward(self, projected_states, output):
        if self.cache_config.mamba_cache_mode != "none" or getattr(self, "num_spec", 0) > 0:
            raise RuntimeError(f"patch {NAME}: prefix caching of Mamba states (mamba_cache_mode align or all) and "
                               "speculative decoding are not covered; turn them off or drop the patch")
        _LAYER.append(self)
        try:
            return original(self, projected_states, output)
        finally:
            _LAYER.pop()
    return conv_ssm_forward


_FUNCS = (("mamba_chunk_scan_combined_varlen", _replay_prefill), ("selective_state_update", _replay_decode),
          ("causal_conv1d_update", conv_as_prefill))


PATCH = Patch(
    name=NAME, target="vllm", versions=">=0.26.0,<0.27", gate="C4",
    symptom="C4 (and C5) fails in a Mamba-2 mixer (mixer): a decoded token differs from the same token prefilled; "
            "vLLM's decode runs selective_state_update, its prefill the chunked scan",
    fix="a Mamba-2 decode step replays its current chunk through the prefill's chunked scan from the chunk's start "
        "state (kept in vLLM's ssm_state slot) with the chunk's earlier tokens (a third state per slot, counted by "
        "vLLM's cache sizing); prefill and chunked-prefill continuations keep the same state; the decode conv runs "
        "the prefill's conv kernel",
    guide="guides/ops/recurrent-layers.md",
    cost="each decode step scans chunk_size tokens per request once; Nemotron-H-8B at full depth on an H100 "
         "(64 requests, 512 -> 256 tokens): 0.139 of vLLM's default throughput",
    **swap_hooks(NAME, *((_MIXER, attr, make, _MIXER) for attr, make in _FUNCS),  # the mixer's calls alone
                 methods=((_MIXER, "MambaMixer2", "conv_ssm_forward", _tracking),
                          # the chunk buffers as a third Mamba state: in the layers' cache specs and in the page
                          # size vLLM aligns the attention blocks to, so vLLM's memory sizing counts them; the
                          # layer's own get_state_shape/get_state_dtype keep their two states (vLLM's kernel
                          # warmup unpacks two)
                          (_MIXER, "MambaMixer2", "get_kv_cache_spec", _sizing(_layer_chunk)),
                          (_PLATFORM, "Platform", "update_block_size_for_backend", _sizing(_config_chunk)),
                          (_UTILS, "MambaStateShapeCalculator", "mamba2_state_shape", _shape_with_buffer),
                          (_UTILS, "MambaStateDtypeCalculator", "mamba2_state_dtype", _dtype_with_buffer))),
)
