"""The mamba-decode-replay patch on CPU, against a stand-in of vLLM 0.26's MambaMixer2.conv_ssm_forward and its
kernels (tests/support/tic_fake_vllm.py: a chunked scan whose reductions are padded to the chunk, a single-step
decode and a decode conv that round otherwise). Three requests go through vLLM-style steps (a chunked prefill
continued mid-chunk next to a decode, a prompt shorter than a chunk whose decode completes its first chunk, then
decodes): with the patch every token's mixer output equals that request's whole sequence prefilled alone; without
it, decoded tokens differ. The GPU run validates vLLM's kernels."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from tic import patches

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
from tic_mixer_serving import serve  # noqa: E402

H, P, G, N, Q, K, SLOTS = 4, 3, 2, 5, 4, 4, 4
I, DIM = H * P, H * P + 2 * G * N
WIDTH = I + DIM + H  # gate | x B C | dt, as in_proj writes them


def _mixer(seed=0):
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2

    g = torch.Generator().manual_seed(seed)
    m = MambaMixer2()
    m.I, m.H, m.P, m.G, m.N, m.Q, m.prefix, m.num_spec = I, H, P, G, N, Q, "mixer", 0
    m.conv_weights, m.bias = 0.5 * torch.randn(DIM, K, generator=g), 0.1 * torch.randn(DIM, generator=g)
    m.A = -torch.exp(torch.rand(H, generator=g))
    m.D, m.dt_bias = torch.randn(H, generator=g), 0.5 * torch.randn(H, generator=g)
    m.K = K
    m.cache_config = SimpleNamespace(mamba_cache_mode="none", mamba_ssm_cache_dtype="auto")
    m.model_config = SimpleNamespace(get_mamba_chunk_size=lambda: Q, dtype=torch.float32)
    m.kv_cache = _cache(m)
    return m


def _cache(m, slots=SLOTS):
    """The mixer's states as vLLM 0.26 lays them out (gpu_model_runner, MambaSpec): one page per slot holding each
    state the mixer's get_state_shape/get_state_dtype name, one after another, as strided views of one buffer. A
    third state (the patch's chunk buffers) starts as NaN: its content before a request writes it must not matter."""
    spec = m.get_kv_cache_spec(None)
    shapes, dtypes = spec.shapes, spec.dtypes
    page = sum(math.prod(shape) * d.itemsize for shape, d in zip(shapes, dtypes))
    raw = torch.zeros(slots * page, dtype=torch.uint8)
    views, offset = [], 0
    for shape, dtype in zip(shapes, dtypes):
        stride = torch.empty((slots, *shape)).stride()
        views.append(torch.as_strided(raw.view(dtype), (slots, *shape), (page // dtype.itemsize, *stride[1:]),
                                      offset // dtype.itemsize))
        offset += math.prod(shape) * dtype.itemsize
    for extra in views[2:]:
        extra.fill_(float("nan"))
    return views


def _step(m, decodes, prefills):
    """One vLLM step: decodes [(slot, row [WIDTH])], prefills [(slot, computed, rows [n, WIDTH])]; the chunk
    metadata as vLLM's builder cuts it (a continuation's first chunk ends at the next multiple of Q)."""
    from vllm.forward_context import ForwardContext, set_forward_context

    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    cu, chunks, seq, last = [0], [0], [], []
    for i, (_, c, rows) in enumerate(prefills):
        pos, end = c, c + rows.shape[0]
        while pos < end:
            take = min(Q - pos % Q, end - pos)
            chunks.append(chunks[-1] + take)
            seq.append(i)
            pos += take
        last.append(len(seq) - 1)
        cu.append(cu[-1] + rows.shape[0])
    meta = SimpleNamespace(
        num_decodes=len(decodes), num_decode_tokens=len(decodes), num_prefills=len(prefills),
        num_prefill_tokens=cu[-1], query_start_loc_p=i32(cu), state_indices_tensor_p=i32([p[0] for p in prefills]),
        has_initial_states_p=torch.tensor([p[1] > 0 for p in prefills]),
        prep_initial_states=any(p[1] > 0 for p in prefills), seq_idx_p=i32(seq), cu_chunk_seqlen_p=i32(chunks),
        last_chunk_indices_p=i32(last), state_indices_tensor_d=i32([[d[0]] for d in decodes]))
    rows = [d[1][None] for d in decodes] + [p[2] for p in prefills]
    projected = torch.cat(rows)
    out = torch.zeros(projected.shape[0], I)
    set_forward_context(ForwardContext({"mixer": meta}))
    m.conv_ssm_forward(projected, out)
    return out


def test_decode_and_a_continued_prefill_replay_the_chunk_as_one_prefill(fake_vllm):
    g = torch.Generator().manual_seed(1)
    seqs = torch.randn(17, WIDTH, generator=g), torch.randn(14, WIDTH, generator=g), torch.randn(11, WIDTH, generator=g)
    whole = [_step(_mixer(), [], [(2, 0, t)]) for t in seqs]  # each request prefilled alone, by vLLM's own prefill
    patches.apply(["mamba-decode-replay"])
    assert patches.active() == ["mamba-decode-replay"]
    got = serve(_step, _mixer(), *seqs)
    for mine, ref in zip(got, whole):
        assert mine.shape == ref.shape and torch.equal(mine, ref), (mine - ref).abs().amax(-1)
    patches.apply([])  # the control: vLLM's own steps
    assert patches.active() == []
    stock = serve(_step, _mixer(), *seqs)
    for mine, ref, prefilled in zip(stock, whole, (5, 6, 2)):
        assert torch.equal(mine[:prefilled], ref[:prefilled])  # first prefills
        assert not torch.equal(mine[prefilled:], ref[prefilled:])


def test_prefix_caching_and_speculative_decoding_stop_the_mixer_with_the_reason(fake_vllm):
    import pytest

    patches.apply(["mamba-decode-replay"])
    for field, value in (("mamba_cache_mode", "all"), ("num_spec", 1)):
        m = _mixer()
        if field == "num_spec":
            m.num_spec = value
        else:
            m.cache_config.mamba_cache_mode = value
        with pytest.raises(RuntimeError, match="mamba-decode-replay: prefix caching .* speculative decoding"):
            _step(m, [], [(0, 0, torch.randn(3, WIDTH))])


class _NoHostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Refuses every operator that brings a device value back to the host (item, int/bool of a tensor, nonzero)."""

    REFUSED = ("_local_scalar_dense", "nonzero", "unique", "masked_select")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(name in str(func) for name in self.REFUSED):
            raise AssertionError(f"host read: {func}")
        return func(*args, **(kwargs or {}))


def test_a_decode_step_reads_nothing_back_to_the_host(monkeypatch):
    """A CUDA graph holds a decode step only if no device value is read on the host: run under a dispatch mode that
    refuses such reads (and with tolist refused), with padding rows and rows in their first chunk, the scan a
    stand-in that only writes its outputs (vLLM's kernel launches are its own). A planted read fails it."""
    import pytest

    from tic.patches.vllm import mamba_decode_replay as mdr

    def scan(x, dt, A, B, C, chunk_size, cu_seqlens, cu_chunk_seqlens, last_chunk_indices, seq_idx, out, **kw):
        out.copy_(x * 0.5)
        return torch.zeros(last_chunk_indices.shape[0], x.shape[1], x.shape[2], B.shape[2])

    n = 3
    store = mdr._Chunks(torch.zeros(SLOTS, Q, H, P), torch.zeros(SLOTS, Q, H), torch.zeros(SLOTS, Q, G, N),
                        torch.tensor([0, 2, 0, 3], dtype=torch.int32), torch.tensor([0, 6, 1, 3]), None)
    state = torch.randn(SLOTS, H, P, N)
    args = (store, state, torch.tensor([1, -1, 3]), torch.randn(n, H, P), torch.randn(n, H), -torch.rand(H),
            torch.randn(n, G, N), torch.randn(n, G, N), torch.randn(H), torch.randn(H), torch.zeros(n, H, P), Q)
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: (_ for _ in ()).throw(AssertionError("tolist")))
    with _NoHostReads():
        mdr._decode_step(scan, *args)
    monkeypatch.undo()
    assert store.count.tolist() == [0, 3, 0, 0] and store.length.tolist() == [0, 7, 1, 4]  # slot 3's chunk filled
    planted = lambda *a: (int(a[3][0]), mdr._decode_step(*a))  # reads a slot on the host  # noqa: E731
    with _NoHostReads(), pytest.raises(AssertionError, match="host read"):
        planted(scan, *args)


def test_the_chunk_buffers_are_a_third_state_that_vllms_sizing_counts(fake_vllm):
    """With the patch, a MambaMixer2's states include the chunk buffers (chunk_size x (H x P + H + G x N) in the
    model's dtype), and vLLM's block-size alignment, which sizes the Mamba page from the model class, counts them
    alike: the page the attention blocks are aligned to is the page the layers allocate. Elsewhere the calculators
    are vLLM's own; the revert restores them."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from vllm.platforms.interface import Platform

    class Model:  # a model class's sizing, as NemotronH's (its own config's sizes, through the calculators)
        @classmethod
        def get_mamba_state_shape_from_config(cls, vllm_config):
            return MambaStateShapeCalculator.mamba2_state_shape(1, I, G, H, P, N, K)

        @classmethod
        def get_mamba_state_dtype_from_config(cls, vllm_config):
            from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator
            return MambaStateDtypeCalculator.mamba2_state_dtype(torch.bfloat16, "auto", "float32")

    def page(shapes, dtypes):
        return sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes))

    cfg = SimpleNamespace(model_cls=Model, model_config=SimpleNamespace(get_mamba_chunk_size=lambda: Q))
    m = _mixer()
    m.model_config.dtype, m.cache_config.mamba_ssm_cache_dtype = torch.bfloat16, "float32"
    def spec():
        s = m.get_kv_cache_spec(None)
        return s.shapes, s.dtypes

    stock = spec()
    Platform.update_block_size_for_backend(cfg)
    assert len(stock[0]) == 2 and cfg.mamba_page_bytes == page(*stock)
    patches.apply(["mamba-decode-replay"])
    shapes, dtypes = spec()
    assert shapes == (*stock[0], (Q, H * P + H + G * N)) and dtypes == (*stock[1], torch.bfloat16)
    Platform.update_block_size_for_backend(cfg)
    assert cfg.mamba_page_bytes == page(shapes, dtypes) > page(*stock)
    assert len(MambaStateShapeCalculator.mamba2_state_shape(1, I, G, H, P, N, K)) == 2  # outside a sizing: vLLM's
    # the layer's own sizing keeps two states: vLLM's kernel warmup unpacks its dtypes as (conv, ssm)
    assert (tuple(m.get_state_shape()), m.get_state_dtype()) == stock
    patches.apply([])
    assert spec() == stock and "get_kv_cache_spec" not in type(m).__dict__
    Platform.update_block_size_for_backend(cfg)
    assert cfg.mamba_page_bytes == page(*stock)


def test_a_cache_sized_without_the_patch_stops_the_replay_with_the_reason(fake_vllm):
    import pytest

    m = _mixer()  # its cache sized by vLLM's own calculators: two states
    patches.apply(["mamba-decode-replay"])
    with pytest.raises(RuntimeError, match="no chunk buffer; the patch must be active before vLLM sizes its cache"):
        _step(m, [], [(1, 0, torch.randn(3, WIDTH))])
