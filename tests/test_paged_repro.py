"""Kernels behind engine wrapper ops: the recorder opens wrapper ops that need the engine's per-step state
(vLLM's attention) and records the kernel they call; a paged varlen attention repro is cut down to the traced
token's own sequence and KV pages, and still reproduces in a fresh process (or is not emitted when the two
layouts agree)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tic.harness.locate import recorder, repro

SUPPORT = Path(__file__).resolve().parent / "support"
sys.path.insert(0, str(SUPPORT))
import tic_pageddemo  # noqa: E402  registers torch.ops.tic_pageddemo / tic_wrapdemo

H, D, BLOCK = 2, 8, 8
LENS = [20, 37, 9]


def _step(rows_per_seq: list[int], pages_order: list[int]):
    """The KV cache, page table and cu_seqlens of one step where sequence s runs its last rows_per_seq[s] rows."""
    g = torch.Generator().manual_seed(0)
    qs = [torch.randn(n, H, D, generator=g) for n in LENS]
    ks = [torch.randn(n, H, D, generator=g) for n in LENS]
    vs = [torch.randn(n, H, D, generator=g) for n in LENS]
    n_pages = [-(-n // BLOCK) for n in LENS]
    total = 20  # a few pages more than the sequences use
    k = torch.zeros(total, BLOCK, H, D)
    v = torch.zeros(total, BLOCK, H, D)
    table = torch.zeros(len(LENS), max(n_pages), dtype=torch.int32)
    free = iter(pages_order)
    for s, n in enumerate(LENS):
        for j in range(n_pages[s]):
            p = next(free)
            table[s, j] = p
            lo, hi = j * BLOCK, min(n, (j + 1) * BLOCK)
            k[p, :hi - lo], v[p, :hi - lo] = ks[s][lo:hi], vs[s][lo:hi]
    q = torch.cat([qs[s][LENS[s] - r:] for s, r in enumerate(rows_per_seq)])
    cu = torch.tensor([0] + list(torch.tensor(rows_per_seq).cumsum(0)), dtype=torch.int32)
    return q, dict(k=k, v=v, cu_seqlens_q=cu, seqused_k=torch.tensor(LENS, dtype=torch.int32),
                   max_seqlen_q=max(rows_per_seq), max_seqlen_k=max(LENS), page_table=table)


def _record(rows_per_seq, pages_order, traced_seq=1):
    """Run the wrapper under the recorder as the locator does; the kernel's OpSide for the traced token
    (the last row of sequence `traced_seq`)."""
    q, meta = _step(rows_per_seq, pages_order)
    tic_pageddemo.STEP["l0"] = meta
    out = torch.zeros_like(q)
    rec = recorder.OpRecorder()
    with rec:
        torch.ops.tic_wrapdemo.attention(q, out, "l0")
    row = int(meta["cu_seqlens_q"][traced_seq + 1]) - 1
    call = next(c for c in rec.calls if c.op == "tic_pageddemo.fwd.default")
    return rec, repro.OpSide(call, {"kind": "row", "row": row, "output": 0}, q.shape[0]), out


@pytest.fixture
def open_demo(monkeypatch):
    monkeypatch.setattr(recorder, "OPEN_NAMESPACES", {"tic_wrapdemo"})
    monkeypatch.setenv("PYTHONPATH", str(SUPPORT))  # the fresh repro process imports the kernel's module


def test_wrapper_is_opened_and_its_kernel_recorded(open_demo):
    rec, side, out = _record([1, 1, 1], list(range(20)))
    ops = [c.op for c in rec.calls]
    assert "tic_pageddemo.fwd.default" in ops and not any(o.startswith("tic_wrapdemo") for o in ops), ops
    assert not rec.errors
    assert torch.equal(side.call.outputs[0], out)  # the kernel's recorded output is what the wrapper wrote


def test_wrapper_outside_open_namespaces_is_one_operator(monkeypatch):
    monkeypatch.setattr(recorder, "OPEN_NAMESPACES", set())
    q, meta = _step([1, 1, 1], list(range(20)))
    tic_pageddemo.STEP["l0"] = meta
    out = torch.zeros_like(q)
    rec = recorder.OpRecorder()
    with rec:
        torch.ops.tic_wrapdemo.attention(q, out, "l0")
    assert [c.op for c in rec.calls] == ["tic_wrapdemo.attention.default"]


def test_decode_vs_prefill_kernel_repro_is_one_sequence_and_reproduces(open_demo, tmp_path):
    _, decode, _ = _record([1, 1, 1], list(range(20)))
    _, prefill, _ = _record(LENS, list(reversed(range(20))))  # other pages: the reduction renumbers them
    res = repro.emit(tmp_path, "C4", decode, prefill, None, "decode", "prefill", "split-KV decode")
    assert res["reproduces"], res["output"]
    assert res["rows_a"] == 1 and res["rows_b"] == LENS[1], res
    data = torch.load(res["tensors"], weights_only=False)
    k_b = data["b"]["args"][1]
    assert k_b.shape[0] == -(-LENS[1] // BLOCK)  # only the traced sequence's KV pages are kept
    assert data["b"]["args"][4].tolist() == [0, LENS[1]]
    assert "DIFFERS tic_pageddemo.fwd.default" in res["output"]


def test_a_kernel_called_directly_on_packed_rows_is_traced_by_row_and_cut_to_its_sequence(open_demo, tmp_path):
    """The training side's way (tic's vLLM provider): a right-padded batch packed to its valid rows by index, the
    kernel called directly with no output buffer, its rows scattered back by index_put_. The traced token stays
    a row through the packing, so the repro is cut to its sequence and reproduces against the decode call."""
    from tic.harness.locate.search import token_value
    from tic.harness.locate.provenance import Provenance

    _, decode, _ = _record([1, 1, 1], list(range(20)))
    q, meta = _step(LENS, list(reversed(range(20))))
    T = max(LENS)
    padded = torch.zeros(len(LENS), T, H, D)  # [B, T, heads, dim], right padded
    cuts = meta["cu_seqlens_q"].tolist()
    for s, n in enumerate(LENS):
        padded[s, :n] = q[cuts[s]:cuts[s + 1]]
    valid = torch.arange(T)[None] < torch.tensor(LENS)[:, None]
    prov = Provenance(len(LENS), T)
    prov.seed(padded)
    rec = recorder.OpRecorder(provenance=prov)
    with rec:
        flat = padded.reshape(-1, H, D)
        rows = valid.reshape(-1).nonzero().squeeze(1)
        qf = flat[rows]
        got = torch.ops.tic_pageddemo.fwd_new(qf, meta["k"], meta["v"], None, meta["cu_seqlens_q"], meta["seqused_k"],
                                              meta["max_seqlen_q"], meta["max_seqlen_k"], meta["page_table"], None, 0)
        back = torch.zeros_like(flat)
        back.index_put_((rows,), got[0])
    assert not rec.errors
    call = next(c for c in rec.calls if c.op == "tic_pageddemo.fwd_new.default")
    f = 1 * T + LENS[1] - 1  # the traced token: sequence 1's last row
    where, value, n_rows = token_value(call.outputs[0], call.out_tokens[0], len(LENS), T, f)
    assert where == {"kind": "row", "row": cuts[2] - 1} and n_rows == sum(LENS)  # its row of the packed layout
    scattered = next(c for c in rec.calls if c.op == "aten.index_put_.default")
    assert token_value(scattered.outputs[0], scattered.out_tokens[0], len(LENS), T, f)[0] == {"kind": "row", "row": f}
    prefill = repro.OpSide(call, {**where, "output": 0}, n_rows)
    res = repro.emit(tmp_path, "C5", decode, prefill, None, "decode", "training prefill", "split-KV decode")
    assert res["reproduces"], res["output"]
    assert res["rows_a"] == 1 and res["rows_b"] == LENS[1], res
    data = torch.load(res["tensors"], weights_only=False)
    assert data["b"]["args"][3] is None and data["b"]["args"][4].tolist() == [0, LENS[1]]


def test_identical_layouts_emit_no_repro(open_demo, tmp_path):
    _, a, _ = _record(LENS, list(range(20)))
    _, b, _ = _record(LENS, list(reversed(range(20))))  # same rows, other pages: the same bits
    res = repro.emit(tmp_path, "C4", a, b, None, "prefill", "prefill, other pages", "none")
    assert not res["reproduces"] and res["script"] is None and res["exit_code"] == 0, res["output"]
    assert not (tmp_path / "repro.py").exists()


def test_repro_runs_the_engines_process_setup_or_refuses(open_demo, tmp_path, monkeypatch):
    """A kernel mode switched on process-wide (as vLLM's batch-invariant mode is): without the runner's setup
    lines the fresh process computes other bits than the engine did, and the repro must refuse (exit 3), not
    report a difference; with them it reproduces."""
    monkeypatch.setitem(tic_pageddemo.MODE, "thirds", True)
    _, decode, _ = _record([1, 1, 1], list(range(20)))
    _, prefill, _ = _record(LENS, list(range(20)))
    res = repro.emit(tmp_path / "bare", "C4", decode, prefill, None, "decode", "prefill", "mode")
    assert not res["reproduces"] and res["exit_code"] == 3, res["output"]
    assert "does not give the value it recorded" in res["output"]
    setup = ["import tic_pageddemo", "tic_pageddemo.MODE['thirds'] = True"]
    res = repro.emit(tmp_path / "setup", "C4", decode, prefill, None, "decode", "prefill", "mode", setup=setup)
    assert res["reproduces"], res["output"]
    assert "tic_pageddemo.MODE['thirds'] = True" in Path(res["script"]).read_text()


def _attention_module(q: torch.Tensor, scale: float):
    """vLLM's attention layer in small: an output buffer, a view of it passed to the wrapper op, whose kernel
    writes a slice of it made inside the wrapper (unrecorded), and a projection that reads the view."""
    buf = torch.empty(q.shape[0] + 2, *q.shape[1:])
    view = buf.view(buf.shape)
    view[q.shape[0]:].zero_()
    torch.ops.tic_wrapdemo.attention(q, view, "l0")
    return torch.ops.aten.mul(view, scale)


def test_module_program_replays_values_written_through_another_view(open_demo, tmp_path):
    from tic.harness.locate.trail import Trail

    q, meta = _step([1, 1, 1], list(range(20)))
    tic_pageddemo.STEP["l0"] = meta
    progs = []
    for scale in (3.0, 3.0000002):  # side B: a different implementation of the same module
        rec = recorder.OpRecorder()
        with rec:
            y = _attention_module(q, scale)
        target = len(rec.calls) - 1
        assert rec.calls[target].op == "aten.mul.Tensor" and not rec.errors
        trail = Trail(rec.calls, 1, y.shape[0], 1)  # the traced token: row 1
        progs.append(repro.module_program(trail, target, {"kind": "row", "row": 1, "output": 0}, y[1]))
    res = repro.emit_module(tmp_path, "C5", "attn", progs[0], progs[1], "A", "B", "aliasing")
    # exit 1 needs both replays to give their recorded values first (a stale buffer read would exit 3)
    assert res["reproduces"], res["output"]


def test_a_view_of_a_buffer_nothing_wrote_is_recorded_as_its_replay_holds_it(open_demo, tmp_path):
    """An empty buffer holds garbage, and a replay's copy of it holds zeros. A view taken of it before anything wrote
    it is recorded as those zeros, so the module's later calls that read it by reference replay to the values
    recorded (recorded as the garbage, the repro ended in error whenever the allocator handed back used memory)."""
    from tic.harness.locate.trail import Trail

    q, meta = _step([1, 1, 1], list(range(20)))
    tic_pageddemo.STEP["l0"] = meta
    progs = []
    for scale in (3.0, 3.0000002):
        rec = recorder.OpRecorder()
        with rec:
            buf = torch.full((q.shape[0] + 2, *q.shape[1:]), 7.0)  # used memory: bits other than zeros
            rec.mark_blank(buf)  # as torch.empty hands it out: nothing has written it
            view = buf.view(buf.shape)
            view[q.shape[0]:].zero_()
            torch.ops.tic_wrapdemo.attention(q, view, "l0")
            y = torch.ops.aten.mul(view, scale)
        assert rec.calls[0].op == "aten.view.default" and torch.equal(rec.calls[0].outputs[0], torch.zeros_like(buf))
        target = len(rec.calls) - 1
        trail = Trail(rec.calls, 1, y.shape[0], 1)
        progs.append(repro.module_program(trail, target, {"kind": "row", "row": 1, "output": 0}, y[1]))
    res = repro.emit_module(tmp_path, "C5", "attn", progs[0], progs[1], "A", "B", "unwritten buffer")
    assert res["reproduces"], res["output"]


def test_in_place_kernel_repro_starts_from_the_recorded_inputs(open_demo, tmp_path):
    """An operator that writes its own inputs: every evaluation (shrink trials, the value kept for the fresh
    process) must start from the recorded inputs, or the fresh process computes something else (exit 3)."""
    g = torch.Generator().manual_seed(1)
    hidden, resid = torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g)
    sides = []
    for rows in (slice(0, 2), slice(0, 8)):  # decode-like 2 rows vs prefill-like 8 rows; the traced row is 1
        x, r = hidden[rows].clone(), resid[rows].clone()
        rec = recorder.OpRecorder()
        with rec:
            torch.ops.tic_pageddemo.add_norm(x, r, 1e-6)
        call = rec.calls[0]
        sides.append(repro.OpSide(call, {"kind": "row", "row": 1, "output": 0}, call.args[0].shape[0]))
    res = repro.emit(tmp_path, "C4", sides[0], sides[1], None, "decode", "prefill", "in-place add_norm")
    assert res["reproduces"], res["output"]
    assert res["rows_b"] == 8  # a custom kernel's rows are not dropped (its other arguments may index them)


def test_repro_imports_every_extension_that_may_define_the_namespace(monkeypatch):
    """torch.ops._C of vLLM lives in vllm._C_stable_libtorch, and other loaded extensions are also named _C:
    the repro imports each (harmless) rather than guess one; torch's own _C only when nothing else matches."""
    import types

    for name in ("vllm._C_stable_libtorch", "vllm.third_party.deep_gemm._C"):
        mod = types.ModuleType(name)
        mod.__file__ = f"/site/{name.replace('.', '/')}.abi3.so"
        monkeypatch.setitem(sys.modules, name, mod)
    assert repro.op_imports("_C.rms_norm.default", "aten.mm.default") == [
        "vllm._C_stable_libtorch", "vllm.third_party.deep_gemm._C"]
    assert repro.op_imports("tic_pageddemo.fwd.default") == ["tic_pageddemo"]
