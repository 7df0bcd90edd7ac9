"""The operator recorder and extension ops that break under Python dispatch (FlashAttention 3's `fwd` in vLLM
0.26 raises "Unable to cast Python instance of type list" when a dispatch mode boxes its call): such an op,
called directly (as the training side's vLLM provider calls FA3), must run as called and be recorded once."""

from __future__ import annotations

import inspect

import pytest
import torch

from tic.harness.locate.recorder import OpRecorder

_LIB = torch.library.Library("tic_test_ext", "DEF")
_LIB.define("fragile_scale(Tensor x, float s) -> Tensor[]")
_LIB.define("fragile_into(Tensor(a!) out, Tensor x) -> ()")
_LIB.define("fragile_into.scaled(Tensor(a!) out, Tensor x, float s) -> ()")


def _refuse_python_dispatch():
    # stands for a compiled kernel whose argument conversion fails once a dispatch mode has boxed the call
    if any(f.function == "__torch_dispatch__" for f in inspect.stack()):
        raise RuntimeError("Unable to cast Python instance of type <class 'list'> to C++ type '?'")


def _fragile_scale(x, s):
    _refuse_python_dispatch()
    return [x * s, x + s]


def _fragile_into(out, x):
    _refuse_python_dispatch()
    out.copy_(x * 3)


_LIB.impl("fragile_scale", _fragile_scale, "CPU")
def _fragile_into_scaled(out, x, s):
    _refuse_python_dispatch()
    out.copy_(x * s)


_LIB.impl("fragile_into", _fragile_into, "CPU")
_LIB.impl("fragile_into.scaled", _fragile_into_scaled, "CPU")


def test_the_stand_in_really_fails_under_a_plain_dispatch_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Plain(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Plain(), pytest.raises(RuntimeError, match="Unable to cast"):
        torch.ops.tic_test_ext.fragile_scale(torch.ones(3), 2.0)


def test_an_extension_op_called_directly_runs_and_is_recorded_once_with_its_neighbours():
    x = torch.arange(4.0)
    rec = OpRecorder()
    with rec:
        y = x + 1  # aten, seen by the dispatch mode
        a, b = torch.ops.tic_test_ext.fragile_scale(y, 2.0)
        out = torch.empty(4)
        torch.ops.tic_test_ext.fragile_into(out, a)
        z = out * b
    assert rec.errors == []
    assert torch.equal(z, ((x + 1) * 2 * 3) * (x + 3))
    names = [c.op for c in rec.calls]
    assert names == ["aten.add.Tensor", "tic_test_ext.fragile_scale.default", "tic_test_ext.fragile_into.default",
                     "aten.mul.Tensor"]
    scale, into, mul = rec.calls[1], rec.calls[2], rec.calls[3]
    assert scale.sources[0][0] == (0, 0)  # its input is the add's output, so a replay chains them
    assert len(scale.outputs) == 2 and torch.equal(scale.outputs[0], (x + 1) * 2)
    assert torch.equal(into.outputs[0], (x + 1) * 6)  # the in-place write counts as its output
    assert into.sources[0][1] == (1, 0)
    assert mul.sources[0] == ((2, 0), (1, 1))
    # replay in this process: the recorded op called with the recorded inputs gives the recorded outputs
    again = scale.func(*scale.args, **scale.kwargs)
    assert all(torch.equal(u, v) for u, v in zip(again, scale.outputs))


def test_a_packet_with_several_overloads_is_resolved_by_its_arguments():
    x = torch.arange(3.0)
    a, b = torch.empty(3), torch.empty(3)
    rec = OpRecorder()
    with rec:
        torch.ops.tic_test_ext.fragile_into(a, x)
        torch.ops.tic_test_ext.fragile_into(b, x, 0.5)
    assert rec.errors == [] and torch.equal(a, x * 3) and torch.equal(b, x * 0.5)
    assert [c.op for c in rec.calls] == ["tic_test_ext.fragile_into.default", "tic_test_ext.fragile_into.scaled"]


def test_an_operator_whose_record_breaks_runs_once(monkeypatch):
    """The bookkeeping after a call (token maps) failing must not run the operator a second time: an
    accumulating in-place write would be applied twice."""
    from tic.harness.locate.provenance import Provenance

    prov = Provenance(1, 3)
    x = torch.ones(1, 3)
    prov.seed(x)

    def broken(*a, **k):
        raise RuntimeError("planted bookkeeping failure")

    monkeypatch.setattr(prov, "after", broken)
    acc = torch.zeros(1, 3)
    rec = OpRecorder(provenance=prov)
    with rec:
        acc.add_(x)
    assert torch.equal(acc, torch.ones(1, 3))  # once, not twice
    assert rec.errors and "ran, not recorded" in rec.errors[0] and rec.calls == []
