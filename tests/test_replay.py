"""tic.harness.locate.replay: a recorded call replayed as the engine ran it (memory layout included), what a replay that
cannot give the recorded bits says, and the kind of difference between two sides' calls."""

from __future__ import annotations

import torch

from tic.harness.locate import replay, repro
from tic.harness.locate.recorder import OpRecorder
from tic.harness.locate.trail import OpCall, Trail
from tic.harness.locate.search import token_parts, trail_rows
from tic.harness.locate.provenance import Provenance


def test_a_copy_keeps_strides_storage_offset_and_alignment():
    base = torch.arange(64.0)
    for t in (base[3:15].view(3, 4), base.view(8, 8)[:, 2:5], torch.arange(4.0).expand(3, 4), base[1:9]):
        for align in (0, 4, 8, 40):
            layout = dict(replay.layout_of(t), align=align)
            got = replay.rebuild(t, layout)
            assert torch.equal(got, t) and replay.not_rebuilt(got, layout) == [], (t.stride(), align)
            assert got.stride() == t.stride() and got.storage_offset() == t.storage_offset()
            assert got.data_ptr() % replay.ALIGN == align
    assert torch.equal(replay.rebuild(base[:6].view(2, 3), zero=True), torch.zeros(2, 3))


def test_a_recorded_argument_is_laid_out_as_the_engines_was():
    """The recorder keeps a GEMV's weight at its address modulo 64 bytes: CPU GEMV kernels give other bits at
    another alignment, so a copy in freshly aligned memory would replay another computation."""
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    moved = torch.empty(w.numel() + 1)[1:].view_as(w)
    moved.copy_(w)
    with torch.inference_mode(), OpRecorder() as rec:  # as an engine's forward runs
        torch.nn.functional.linear(x, moved)
    call = next(c for c in rec.calls if c.op == "aten.linear.default")
    assert call.args[1].data_ptr() % 64 == moved.data_ptr() % 64 == call.layouts[0][1]["align"]
    with torch.inference_mode():
        assert torch.equal(torch.nn.functional.linear(*call.args), call.outputs[0])


def test_a_replay_that_does_not_give_the_recorded_bits_says_what_it_could_not_rebuild(tmp_path):
    """The engine's value is kept when the replay here does not give it; the fresh run then exits 3 and names the
    recorded property it could not rebuild (an address no float32 can have), or says that every property was
    rebuilt."""
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    w = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    engine = x @ w
    engine[1, 0] = torch.nextafter(engine[1, 0], torch.tensor(10.0))  # what "the engine" gave: not what mm gives here
    for align, says in ((2, "could not rebuild argument 0: align"), (0, "every argument's shape, strides")):
        layouts = ((dict(replay.layout_of(x), align=align), replay.layout_of(w)), {})
        call = OpCall("aten.mm.default", torch.ops.aten.mm.default, (x, w), {}, (engine,), layouts=layouts)
        side = repro.OpSide(call, {"kind": "row", "output": 0, "row": 1}, 3)
        other = repro.OpSide(OpCall("aten.mm.default", torch.ops.aten.mm.default, (x, w), {}, (x @ w,)),
                             {"kind": "row", "output": 0, "row": 1}, 3)
        res = repro.emit(tmp_path / str(align), "C5", other, side, None, "a", "b", "mismatch")
        assert says in res["replay_mismatch"]["B"], res["replay_mismatch"]
        assert res["exit_code"] == 3 and not res["reproduces"] and says in res["output"], res["output"]


def test_cat_and_stack_inputs_are_traced_and_split_pieces_keep_their_tokens():
    """A cat or stack of several traced tensors records each piece as a traced input (its counterpart's inputs can
    then be checked); split/chunk/unbind pieces and element-wise multi-input ops keep each element's token."""
    B, T, D, f = 1, 3, 4, 1
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(B, T, D, generator=g), torch.randn(B, T, D, generator=g)
    trail = Trail([], B, T, f)
    prov = Provenance(B, T)
    prov.seed(x)
    prov.seed(y)
    with OpRecorder(trail.calls, trail.errors, provenance=prov):
        c = torch.cat([x, y], dim=-1)
        s = torch.stack([x, y])
        first, second = c.chunk(2, dim=-1)
        _ = torch.where(first > 0, second, s.unbind(0)[0]) * 2
    outs, ins = trail_rows(trail)
    by_op = {call.op: i for i, call in enumerate(trail.calls)}
    for op in ("aten.cat.default", "aten.stack.default"):
        i = by_op[op]
        parts = token_parts(trail, trail.calls[i])[0][0]  # the list argument: one part per tensor
        assert [p.tolist() for p in parts] == [x[0, f].tolist(), y[0, f].tolist()], op
        assert len(ins[i]) == 2 and outs[i][0][2].numel() == 2 * D, op
    mul = outs[by_op["aten.mul.Tensor"]][0][2]
    want = torch.where(x[0, f] * 0 + c[0, f, :D] > 0, c[0, f, D:], x[0, f]) * 2
    assert torch.equal(mul.reshape(-1), want)


def test_the_kind_of_difference_is_decided_from_the_two_calls():
    """Identical calls -> one operator on the same arguments, identical in every property; the traced token's row
    the same but more rows beside it -> the same arguments, the launch's shape named; a differing element, an
    operator of its own, no call at all -> an argument that differs, or other operator sequences."""
    from tic.harness.locate import replay

    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    w = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    call = {"op": "aten.mm.default", "args": (x, w), "kwargs": {}, "where": {"kind": "row", "row": 1, "output": 0},
            "token_args": ((x[1], None), {})}
    same = replay.difference(call, dict(call))
    assert same["kind"] == replay.SAME_ARGUMENTS and "identical in every recorded property" in same["detail"]
    wider = dict(call, args=(torch.cat([x, x]), w), token_args=((x[1], None), {}))
    assert replay.claim(call, wider) == (f"{replay.SAME_ARGUMENTS}: the calls differ in argument 0 (self)'s shape "
                                        "[3, 8] vs [6, 8] (3 vs 6 rows)")
    nudged = x.clone()
    nudged[1, 0] = torch.nextafter(nudged[1, 0], torch.tensor(10.0))
    got = replay.difference(call, dict(call, args=(nudged, w), token_args=((nudged[1], None), {})))
    assert got["kind"] == replay.ARGUMENTS_DIFFER and got["argument"] == 0, got
    assert got["detail"].startswith("argument 0 (self): the traced token's part differs (first at element 0"), got
    other_w = replay.difference(call, dict(call, args=(x, w + 1)))
    assert other_w["kind"] == replay.ARGUMENTS_DIFFER and other_w["argument"] == 1, other_w
    assert replay.claim(call, dict(call, op="aten.addmm.default")).startswith(replay.SEQUENCES_DIFFER)
    assert replay.claim(None, call).startswith(f"{replay.SEQUENCES_DIFFER}: side A has no such operator")
    moved = dict(call, layouts=(({**replay.layout_of(x), "align": 16}, replay.layout_of(w)), {}))
    got = replay.difference(call, moved)
    assert got["kind"] == replay.SAME_ARGUMENTS and got["differs_in"] == [
        f"argument 0 (self)'s address mod 64 bytes {replay.layout_of(x)['align']} vs 16"], got


