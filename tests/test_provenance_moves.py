"""Token provenance through operators that only move elements (tic.harness.locate.provenance): a varlen kernel's packed
rows (`x[index]`), their scatter back (`index_put_`), pads, row selections and gathers keep each element's token;
filled or untouched elements belong to no token, and an accumulating write keeps a token only where both agree."""

from __future__ import annotations

import pytest
import torch

from tic.harness.locate import provenance
from tic.harness.locate.recorder import OpRecorder
from tic.harness.locate.provenance import Provenance

B, T, H, D = 2, 5, 2, 3
VALID = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)


def _rows(m: torch.Tensor) -> list[int]:
    """A map's token per leading index (every element of a row must agree)."""
    flat = m.reshape(m.shape[0], -1)
    assert bool((flat == flat[:, :1]).all()), flat
    return flat[:, 0].tolist()


def _trail(fn):
    prov = Provenance(B, T)
    x = torch.randn(B, T, H, D)
    prov.seed(x)
    rec = OpRecorder(provenance=prov)
    with rec:
        fn(x)
    assert not rec.errors
    return {c.op: c for c in rec.calls}, prov


def test_packed_rows_and_their_scatter_back_keep_their_tokens():
    def fn(x):
        flat = x.reshape(B * T, H, D)
        idx = VALID.reshape(-1).nonzero().squeeze(1)
        packed = flat[idx]
        out = torch.full_like(flat, 0.5).index_put_((idx,), packed * 2)
        torch.nn.functional.pad(packed, (0, 0, 0, 0, 1, 2))
        packed.index_select(0, torch.tensor([4, 0]))
        torch.gather(packed[:, 0, 0], 0, torch.tensor([7, 7, 1]))

    calls, _ = _trail(fn)
    packed_tokens = [0, 1, 2, 5, 6, 7, 8, 9]
    assert _rows(calls["aten.index.Tensor"].out_tokens[0]) == packed_tokens
    # full_like's values are a constant: no token; index_put_ writes the packed rows' tokens into rows 0-2, 5-9 only
    assert calls["aten.full_like.default"].out_tokens[0] is None
    assert _rows(calls["aten.index_put_.default"].out_tokens[0]) == [0, 1, 2, -1, -1, 5, 6, 7, 8, 9]
    assert _rows(calls["aten.constant_pad_nd.default"].out_tokens[0]) == [-1] + packed_tokens + [-1, -1]
    assert _rows(calls["aten.index_select.default"].out_tokens[0]) == [6, 0]
    assert calls["aten.gather.default"].out_tokens[0].tolist() == [9, 9, 1]


def test_an_accumulating_scatter_keeps_a_token_only_where_old_and_new_agree():
    def fn(x):
        flat = x.reshape(B * T, H, D).clone()
        flat.index_put_((torch.tensor([0, 1]),), flat[5:7].clone(), accumulate=True)  # rows 0, 1 += rows 5, 6

    calls, _ = _trail(fn)
    put = next(c for c in calls.values() if c.op == "aten.index_put_.default")
    assert _rows(put.out_tokens[0]) == [-1, -1, 2, 3, 4, 5, 6, 7, 8, 9]


def test_nothing_traced_moving_builds_no_map(monkeypatch):
    """A gather from an untraced tensor (a weight, a cos/sin table) is decided before any map is built, then
    left to the shape rules (a [B, T] index -> [B, T, D] lookup)."""
    built = []
    real_zeros = torch.zeros

    def counting_zeros(*a, **k):
        built.append(a)
        return real_zeros(*a, **k)

    table = torch.randn(64, D)
    prov = Provenance(B, T)
    pos = torch.arange(T).repeat(B, 1)
    prov.seed(pos)
    monkeypatch.setattr(provenance.torch, "zeros", counting_zeros)
    rec = OpRecorder(provenance=prov)
    with rec:
        looked = table[pos]
    monkeypatch.setattr(provenance.torch, "zeros", real_zeros)
    call = next(c for c in rec.calls if c.op == "aten.index.Tensor")
    assert built == []
    assert call.out_tokens[0][1, 3].tolist() == [8] * D and looked.shape == (B, T, D)


def test_an_overwrite_replaces_the_old_token_and_a_fill_value_is_no_token():
    def fn(x):
        flat = x.reshape(B * T, H, D).clone()
        flat.index_put_((torch.tensor([0]),), flat[5:6].clone())  # row 0 now holds token 5's values
        torch.nn.functional.pad(flat, (0, 0, 0, 0, 0, 1), value=1.0)

    calls, _ = _trail(fn)
    assert _rows(calls["aten.index_put_.default"].out_tokens[0]) == [5, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert _rows(calls["aten.constant_pad_nd.default"].out_tokens[0]) == [5, 1, 2, 3, 4, 5, 6, 7, 8, 9, -1]


@pytest.mark.filterwarnings("ignore:The reduce argument of torch.scatter")
def test_several_sources_in_one_element_keep_a_token_only_when_they_agree():
    """Duplicate indices with accumulate=True, scatter_add and a scatter reduction sum their sources: an
    element is one token's only if every source of it, the buffer's own old value included, is that token."""
    def fn(x):
        flat = x.reshape(B * T, H, D)
        fresh = torch.zeros(4, H, D)
        fresh.index_put_((torch.tensor([1, 1, 2, 2]),), flat[torch.tensor([3, 3, 3, 4])].clone() * 1.0,
                         accumulate=True)  # row 1: token 3 twice; row 2: tokens 3 and 4
        flat.index_put((torch.tensor([1]),), flat[2:3].clone(), accumulate=True)  # out of place: 1 + 2
        col = flat[:, 0, 0].clone()
        torch.scatter_add(col, 0, torch.tensor([0, 6]), col[torch.tensor([0, 5])].clone())  # 0 += 0; 6 += 5
        torch.scatter(col, 0, torch.tensor([7]), col[8:9].clone(), reduce="multiply")  # 7 *= 8
        torch.scatter_reduce(col, 0, torch.tensor([2, 9]), col[torch.tensor([2, 1])].clone(), "amax")  # 9 vs 1

    calls, _ = _trail(fn)
    assert _rows(calls["aten.index_put_.default"].out_tokens[0]) == [-1, 3, -1, -1]
    assert _rows(calls["aten.index_put.default"].out_tokens[0]) == [0, -1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert calls["aten.scatter_add.default"].out_tokens[0].tolist() == [0, 1, 2, 3, 4, 5, -1, 7, 8, 9]
    assert calls["aten.scatter.reduce"].out_tokens[0].tolist() == [0, 1, 2, 3, 4, 5, 6, -1, 8, 9]
    assert calls["aten.scatter_reduce.two"].out_tokens[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, -1]


def test_recording_an_out_overload_leaves_its_result_alone():
    prov = Provenance(B, T)
    ids = torch.randint(-1000, 1000, (B, T))
    prov.seed(ids)
    want = torch.gather(ids, 1, torch.tensor([[4, 0], [2, 2]]))
    got = torch.empty(2, 2, dtype=torch.int64)
    with OpRecorder(provenance=prov) as rec:
        torch.gather(ids, 1, torch.tensor([[4, 0], [2, 2]]), out=got)
    assert not rec.errors and torch.equal(got, want)


def test_coordinates_of_a_mask_are_no_values_of_the_token():
    """nonzero gives where a mask is set: positions in its input's layout (a padded row's keys sit elsewhere in
    another layout), not values of the token, so they carry no token and are never compared as its values."""
    B, T = 1, 3
    mask = torch.tensor([[True, False, True, True]] * 3).reshape(B, T, 4).float()
    prov = Provenance(B, T)
    prov.seed(mask)
    rec = OpRecorder(provenance=prov)
    with rec:
        mask[0, 1].nonzero()
    call = next(c for c in rec.calls if c.op == "aten.nonzero.default")
    assert call.arg_tokens[0] is not None and call.out_tokens[0] is None


def test_a_reduction_keeps_the_token_of_what_it_reduces():
    """An MoE block sums a token's top-k slots ([T, k, D] -> [T, D], no keepdim): the sum is that token's; a sum
    over the tokens mixes them and is nobody's."""
    B, T, k, D = 1, 3, 2, 4
    slots = torch.randn(B * T, k, D)
    prov = Provenance(B, T)
    prov.seed(slots)
    rec = OpRecorder(provenance=prov)
    with rec:
        slots.sum(1)
        slots.sum(0)
        slots.amax(dim=(1, 2))
    per_token, everyone, row_max = (c.out_tokens[0] for c in rec.calls)
    assert per_token.tolist() == [[t] * D for t in range(B * T)]
    assert everyone is None
    assert row_max.tolist() == list(range(B * T))


def test_the_addends_a_wrapped_layer_reads_in_place_of_its_input_carry_the_inputs_tokens():
    """The kernel wrappers' next layer normalises the two addends its input was summed from (ResidualStream), which
    were computed before the trail began: while a trail records, they take the input's tokens
    (tic.harness.kernels.stand_ins); outside a recording nothing is given tokens."""
    from tic.harness.kernels.modules import ResidualStream

    stream = ResidualStream()
    delta, residual = torch.randn(B, T, H * D), torch.randn(B, T, H * D)
    x = residual + delta
    prov = Provenance(B, T)
    prov.seed(x)
    stream.put(x, delta, residual)
    with OpRecorder(provenance=prov):
        got = stream.take(x)
    assert got[0] is delta and got[1] is residual
    for addend in got:
        assert _rows(prov.tokens(addend).flatten(0, 1)) == list(range(B * T))
    later = torch.randn(B, T, H * D)
    stream.put(x, later, residual)
    stream.take(x)
    assert prov.tokens(later) is None


def test_a_persistent_buffer_larger_than_a_map_keeps_the_tokens_of_the_rows_a_step_fills(monkeypatch):
    """vLLM's V1 runner steps through buffers sized for its largest batch; a step fills their first rows. A map
    covers the part of such a storage its tensors use, so at real shapes (where the whole buffer is larger than
    a map may be) the filled rows keep their tokens, and a later view of more of the buffer grows the map."""
    monkeypatch.setattr(provenance, "MAX_STORAGE_ELEMENTS", 2 * B * T * H * D)  # the buffer: 4 such batches
    buffer = torch.zeros(4 * B * T, H, D)

    def fn(x):
        rows = buffer[B * T: 2 * B * T]  # a step's rows, away from the storage's start
        rows.copy_(x.reshape(B * T, H, D))
        return rows * 2

    calls, prov = _trail(fn)
    doubled = calls["aten.mul.Tensor"].outputs[0]
    assert _rows(calls["aten.mul.Tensor"].out_tokens[0]) == list(range(B * T)) and doubled.shape[0] == B * T
    assert _rows(prov.tokens(buffer[B * T: 2 * B * T])) == list(range(B * T))
    assert prov.tokens(buffer) is None  # the whole buffer spans more than a map: no map for it as a whole
    grown = buffer[B * T: 3 * B * T]  # within the limit: the map grows to cover it, the old tokens kept
    prov._set(grown[B * T:], torch.zeros(B * T, H, D, dtype=torch.int32))
    assert _rows(prov.tokens(grown)) == list(range(B * T)) + [0] * (B * T)
