"""Kernels launched from Python outside torch's dispatcher (Triton-style `kernel[grid](...)`) are recorded as
operator calls through the launch registry (tic.harness.locate.launch_record): the locator names such a kernel as the
first divergent operator, and its repro relaunches it by import path in a fresh process. A stand-in launcher
(tests/support/tic_fakejit.py, NumPy on the tensors' memory) replaces Triton, which CI does not have; the
training side's kernels run through tic's autograd wrappers (`Ops`) of each engine's own provider."""

from __future__ import annotations

import pickle
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tic.harness.locate import launch_record
from tic.harness.locate.hf_capture import HFCaptureRunner
from tic.harness.locate.recorder import OpRecorder
from tic.harness.engines.base import Sampling
from tic.harness.locate.search import Side, locate
from tic.harness.locate.replay import rebuild

ROOT = Path(__file__).resolve().parent.parent
SUPPORT = Path(__file__).resolve().parent / "support"
sys.path.insert(0, str(SUPPORT))
import tic_fakejit  # noqa: E402
from tic_locate_pair import engines, locate_pair  # noqa: E402

FAKE = launch_record.LaunchEntry("tic_fakejit", "FakeJIT", "run")
KERNEL = "tic_fakejit:rms_norm_kernel"


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(SUPPORT))  # the fresh repro process imports the kernel by its path
    launch_record.register(FAKE)
    yield
    launch_record.unregister(FAKE)


def _engines():
    return engines(ROOT / "examples" / "tiny-qwen3" / "tic-consistent.yaml")


def launch_norms(model, kernel=tic_fakejit.rms_norm_kernel, block: int = 64) -> None:
    """Every RMSNorm of this model (through the autograd wrappers' provider) launches `kernel` from Python."""
    provider = model._tic_provider
    assert model._tic_ops.provider is provider  # this model's own copy: a plant stays on its side
    provider.rms_norm = lambda x, w, eps: tic_fakejit.rms_norm(x, w, eps, kernel=kernel, block=block)


_locate = locate_pair


def _rerun(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120)


def test_planted_block_size_in_a_launched_kernel_is_located_and_reproduced(tmp_path, monkeypatch, registered):
    monkeypatch.chdir(tmp_path)
    a, b = _engines()
    launch_norms(a.model)
    launch_norms(b.model, block=16)  # the plant: side B's launches sum the squares in blocks of 16
    res = _locate(a, b, tmp_path / "out")
    assert res["status"] == "localized", res["status"]
    assert res["first_divergent_layer"] == "model.layers.0"
    assert res["culprit_module"] == "model.layers.0.input_layernorm"
    assert res["first_operator"] == KERNEL
    assert "BLOCK=16" in res["operator_args"]["b"] and "BLOCK=64" in res["operator_args"]["a"]
    check = res["repro_check"]
    assert check["reproduces"] and check["exit_code"] == 1, check
    # BLOCK differs: an argument that differs, named, not one operator on the same arguments
    assert check["proves"] == "same operator, arguments that differ: argument BLOCK: 64 on side A, 16 on side B", \
        check["proves"]
    script = Path(res["repro"]).read_text()
    assert "tic_fakejit" in script and "Needs torch and tic_fakejit" in script
    proc = _rerun(res["repro"])
    assert proc.returncode == 1 and f"DIFFERS {KERNEL}" in proc.stdout, proc.stdout + proc.stderr
    # the same repro without the plant: side B launched with side A's BLOCK gives side A's bits, exit 0
    data = torch.load(check["tensors"], weights_only=False)
    spec = data["b"]["launch"]
    assert spec["kernel"] == KERNEL and isinstance(spec["grid"], tuple) and spec["written"] == (2,)
    data["b"]["kwargs"]["BLOCK"] = data["a"]["kwargs"]["BLOCK"]
    relaunch = launch_record.KernelLaunch(FAKE, spec["kernel"], spec["hops"], spec["grid"], spec["written"])
    args = tuple(rebuild(x) if isinstance(x, torch.Tensor) else x for x in data["b"]["args"])
    got = relaunch(*args, **data["b"]["kwargs"])[data["b"]["where"]["output"]]
    data["b"]["expect"] = got[data["b"]["where"]["row"]].clone()
    torch.save(data, check["tensors"])
    proc = _rerun(res["repro"])
    assert proc.returncode == 0 and "identical" in proc.stdout, proc.stdout + proc.stderr


def test_another_launched_kernel_on_one_side_is_named_and_its_module_replayed(tmp_path, monkeypatch, registered):
    monkeypatch.chdir(tmp_path)
    a, b = _engines()
    launch_norms(a.model)
    launch_norms(b.model, kernel=tic_fakejit.rms_norm_kernel_pairs)
    res = _locate(a, b, tmp_path / "out")
    assert res["culprit_module"] == "model.layers.0.input_layernorm"
    # each side's own launch is named: there is no call of one operator to compare
    assert res["first_operator"] == "tic_fakejit:rms_norm_kernel_pairs", res
    calls = res["difference"]["calls"]
    assert calls["A"]["operator"] == KERNEL and calls["B"]["operator"] == "tic_fakejit:rms_norm_kernel_pairs", calls
    assert res["repro_check"]["reproduces"], res["repro_check"]  # both sides' module programs relaunched
    assert res["repro_proves"].startswith("different operator sequences")
    assert _rerun(res["repro"]).returncode == 1


def test_control_with_launched_kernels_reports_nothing(tmp_path, monkeypatch, registered):
    monkeypatch.chdir(tmp_path)
    a, b = _engines()
    launch_norms(a.model)
    launch_norms(b.model)
    res = _locate(a, b, tmp_path / "out")
    assert res["status"] == "no divergence" and res["repro"] is None
    assert all(r["equal"] for r in res["layers"])


def test_without_the_registry_entry_the_launched_kernel_is_not_found(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a, b = _engines()
    launch_norms(a.model)
    launch_norms(b.model, block=16)
    res = _locate(a, b, tmp_path / "out")
    assert res["culprit_module"] == "model.layers.0.input_layernorm"  # the module is found by its rows ...
    assert res["status"] == "localized to a module; operator not resolved"  # ... but not the kernel: no trail
    assert res["first_operator"] is None and res["repro"] is None and res["operators_b"] == []


def test_launch_recording_unit(registered):
    """One launch = one call: cloned inputs, the written argument as output, the callable grid resolved, nothing
    dispatched inside recorded, replayable here; the entry point is restored after recording, even on error."""
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    w = torch.rand(8, generator=torch.Generator().manual_seed(1)) + 0.5
    original = tic_fakejit.FakeJIT.run
    with OpRecorder() as rec:
        assert tic_fakejit.FakeJIT.run is not original
        y = tic_fakejit.rms_norm(x, w, 1e-6)
    assert tic_fakejit.FakeJIT.run is original
    launches = [c for c in rec.calls if c.op == KERNEL]
    assert len(launches) == 1 and not rec.errors, rec.errors
    assert not [c for c in rec.calls if "detach" in c.op or "empty_like" in c.op]  # inside / uninitialised
    call = launches[0]
    assert call.func.launch_spec["grid"] == (3,) and call.func.written == (2,)
    assert torch.equal(call.outputs[0], y.reshape(3, 8))
    assert torch.equal(call.args[2], torch.zeros(3, 8))  # a fresh empty_like buffer is recorded as zeros
    assert torch.equal(call.func(*[a.clone() if isinstance(a, torch.Tensor) else a for a in call.args],
                                 **call.kwargs)[0], call.outputs[0])
    # across a process boundary (ranks send trails pickled) the launch resolves its kernel by import path
    moved = pickle.loads(pickle.dumps(call.func))
    assert torch.equal(moved(*[a.clone() if isinstance(a, torch.Tensor) else a for a in call.args],
                             **call.kwargs)[0], call.outputs[0])
    with OpRecorder() as rec:  # a launch from another thread is not part of this thread's recorded call
        worker = threading.Thread(target=tic_fakejit.rms_norm, args=(x, w, 1e-6))
        worker.start()
        worker.join()
    assert not [c for c in rec.calls if c.op == KERNEL]
    with pytest.raises(RuntimeError, match="boom"):
        with OpRecorder():
            raise RuntimeError("boom")
    assert tic_fakejit.FakeJIT.run is original


def test_a_launch_on_another_grid_is_not_an_identical_call():
    from tic.harness.locate.replay import SAME_ARGUMENTS, difference

    x = torch.ones(2, 4)
    spec = {"kernel": KERNEL, "hops": 0, "fn_attr": "fn", "method": "run", "grid_kwarg": "grid",
            "warmup_kwarg": "warmup", "grid": (2,), "written": (2,)}
    a = {"op": KERNEL, "launch": spec, "args": (x, 4), "kwargs": {}, "where": {"kind": "row", "output": 0, "row": 0}}
    same = difference(a, dict(a))
    assert same["kind"] == SAME_ARGUMENTS and same["differs_in"] == [], same
    assert "identical in every recorded property" in same["detail"]
    other = difference(a, dict(a, launch=dict(spec, grid=(1,))))
    assert other["kind"] == SAME_ARGUMENTS and other["differs_in"] == ["the launch grid (2,) vs (1,)"], other


def test_layout_copy_keeps_the_strides_a_kernel_addresses():
    base = torch.arange(24.0).reshape(3, 8)
    view = base[:, 2:5]  # rows 8 apart: not dense, clone() would make it contiguous
    got = rebuild(view)
    assert got.stride() == view.stride() and torch.equal(got, view)
    assert torch.equal(rebuild(view, zero=True), torch.zeros(3, 3))


def test_a_kernel_not_importable_by_its_path_is_recorded_and_said_so(registered):
    @tic_fakejit.FakeJIT
    def local_norm(x_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK=64):  # defined in a function: no import path
        tic_fakejit.rms_norm_kernel.fn(x_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK)

    x, w = torch.randn(2, 8), torch.ones(8)
    with OpRecorder() as rec:
        tic_fakejit.rms_norm(x, w, 1e-6, kernel=local_norm)
    launched = [c.op for c in rec.calls if ":" in c.op]
    assert len(launched) == 1 and launched[0].endswith(".<locals>.local_norm"), launched
    assert any("cannot import the kernel" in e for e in rec.errors), rec.errors


def test_recheck_after_the_plant_is_removed_relaunches_the_unplanted_kernel(tmp_path, monkeypatch, registered):
    """locate.recheck_repro on a launched kernel: side B launched again without the plant, the emitted repro
    exits 0; with the plant still in, 1."""
    from tic.harness.locate.search import recheck_repro

    monkeypatch.chdir(tmp_path)
    a, b = _engines()
    launch_norms(a.model)
    launch_norms(b.model, block=16)
    sp = Sampling(temperature=1.0, max_tokens=3, seed=0)
    samples = a.generate([[5, 17, 99, 3, 250, 31], [7, 8, 9]], sp, [0, 1])
    ra, rb = HFCaptureRunner(a), HFCaptureRunner(b)
    side_a = Side("decode", ra, lambda spec: ra.decode(samples, 0, 2, spec))
    side_b = Side("score", rb, lambda spec: rb.score(samples, 0, spec))
    res = locate(side_a, side_b, tmp_path / "out", "plant", 2)
    assert res.first_operator == KERNEL and res.repro_check["exit_code"] == 1, res.status
    still = recheck_repro(side_a, side_b, res, "B", tmp_path / "still")
    assert still["kind"] == "operator" and still["exit_code"] == 1, still
    launch_norms(b.model)  # the plant removed: side B launches with side A's block size
    gone = recheck_repro(side_a, side_b, res, "B", tmp_path / "gone")
    assert gone["kind"] == "operator" and gone["exit_code"] == 0, gone


def test_a_write_into_a_fresh_buffer_is_seen_even_when_its_old_bits_were_the_result(registered):
    """Freed memory handed out again can already hold exactly what the launch writes (the same computation just
    ran): the launch must still be recorded with that buffer as its output (the recorder fills a buffer nobody
    wrote with a fixed pattern first)."""
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    w = torch.rand(8, generator=torch.Generator().manual_seed(1)) + 0.5
    y = tic_fakejit.rms_norm(x, w, 1e-6)
    with OpRecorder() as rec:
        out = torch.empty_like(x)  # uninitialised: blank for the recorder
        rec.busy += 1  # as if the allocator handed back memory holding the result: unseen by the recorder
        out.copy_(y)
        rec.busy -= 1
        tic_fakejit.rms_norm_kernel[(3,)](x, w, out, 8, 1e-6, BLOCK=64)
    launches = [c for c in rec.calls if c.op == KERNEL]
    assert len(launches) == 1 and launches[0].func.written == (2,), rec.errors
    assert torch.equal(launches[0].outputs[0], y)
