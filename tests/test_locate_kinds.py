"""Each kind of difference the locator reports, planted on CPU, ends in its own verdict with a repro that exits 1
in a fresh process:
  - the same operator, the traced token's arguments bit-identical, different bits: a norm kernel whose reduction
    order follows the launch's row count (vLLM's rms_norm on the GPU picks its block from the rows), a GEMM on a
    weight at another alignment (CPU GEMV kernels take another path);
  - the same operator on arguments that differ: a GEMM in float64 on one side, the argument and where it came
    from named;
  - different operator sequences: a multiply by a constant inside attention, a rounding before a cat of two
    traced tensors; the operator found is named, never replaced by a list of names."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tic.harness.testing import plant_kernels

from tic.harness.locate import replay, repro
from tic.harness.locate import report
from tic.harness.locate.search import locate, recheck_repro

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
from tic_locate_pair import engines, locate_pair, sides  # noqa: E402

CONFIG = Path(__file__).resolve().parent.parent / "examples" / "tiny-qwen3" / "tic-consistent.yaml"
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture
def pair(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return engines(CONFIG)


def _fresh_run_exits_1(res: dict) -> None:
    assert res["repro"], res.get("repro_check")
    check = res["repro_check"]
    assert check["reproduces"] and check["exit_code"] == 1, check
    assert check["proves"] == res["repro_proves"] and f"PROVES: {res['repro_proves']}" in check["output"]


def _rows_norm(model) -> None:
    """Every RMSNorm of this model runs the row-count-dependent stand-in kernel (this model's own provider)."""
    provider = model._tic_provider
    assert model._tic_ops.provider is provider
    provider.rms_norm = plant_kernels.rms_norm


def test_a_norm_whose_reduction_follows_the_row_count_is_proven_on_identical_arguments(pair, tmp_path):
    """Both sides run the same norm kernel; the decode step launches it on a few rows, the scoring forward on many.
    The traced token's row is bit-identical on both sides: the verdict is one operator on the same arguments, the
    repro replays both launches with all their rows and names the row counts."""
    a, b = pair
    for m in (a.model, b.model):
        _rows_norm(m)
    res = locate_pair(a, b, tmp_path / "out")
    # which norm's launch first changes the traced token's bits follows the data, and so the CPU's GEMM kernels
    assert res["culprit_module"].rsplit(".", 1)[-1] in ("input_layernorm", "post_attention_layernorm", "q_norm",
                                                         "k_norm", "norm"), res["module_trail"]
    assert res["first_operator"] == "plant_kernels.rms_norm.default"
    diff = res["difference"]
    assert diff["kind"] == replay.SAME_ARGUMENTS, diff
    assert "argument 1 (input)'s shape" in diff["detail"] and "rows)" in diff["detail"], diff
    _fresh_run_exits_1(res)
    assert res["repro_proves"].startswith(replay.SAME_ARGUMENTS)
    assert res["repro_check"]["rows_a"] != res["repro_check"]["rows_b"]  # each launch with all its rows
    # the control: side B's row launched with as many rows as side A's launch had gives side A's bits, and the
    # same script says so (exit 0): the row count is what differs
    data = torch.load(res["repro_check"]["tensors"], weights_only=False)
    call_a, call_b = data["a"], data["b"]
    rows_a, where_b = call_a["args"][1].shape[0], call_b["where"]
    # the traced token's rows in side B's launch: one row, or one per head for a per-head norm (a mask)
    traced = (where_b["mask"].reshape(call_b["args"][1].shape[0], -1).any(-1).nonzero().flatten().tolist()
              if where_b["kind"] == "mask" else [where_b["row"]])
    keep = traced + [r for r in range(call_b["args"][1].shape[0]) if r not in traced][:rows_a - len(traced)]
    x = call_b["args"][1][keep]
    where = (dict(where_b, mask=torch.arange(len(keep)).unsqueeze(-1).expand_as(x) < len(traced))
             if where_b["kind"] == "mask" else dict(where_b, row=0))
    call_b.update(args=(torch.zeros_like(x), x) + tuple(call_b["args"][2:]), where=where, layouts=None)
    call_b["expect"] = replay.pick(replay.run_call(call_b, call_b["args"], {}), call_b["where"]).clone()
    again = repro.rerun(Path(res["repro"]), data, tmp_path / "as-many-rows")
    assert again["exit_code"] == 0 and "identical" in again["output"], again


def test_a_norm_behind_an_opened_wrapper_is_proven_on_identical_arguments(pair, tmp_path, monkeypatch):
    """vLLM's rms_norm is a wrapper op (vllm_ir) that allocates its output with torch.empty, then has `_C.rms_norm`
    write it. The locator opens such wrappers below the dispatch mode, which then never sees that allocation: the
    output buffer's garbage must still not count as an argument, or the verdict names it as the difference."""
    from tic.harness.locate import recorder

    monkeypatch.setattr(recorder, "OPEN_NAMESPACES", recorder.OPEN_NAMESPACES | {"plant_wrapper"})
    a, b = pair
    for m in (a.model, b.model):
        m._tic_provider.rms_norm = plant_kernels.rms_norm_in_wrapper
    res = locate_pair(a, b, tmp_path / "out")
    assert res["first_operator"] == "plant_kernels.rms_norm.default"  # the kernel, not the wrapper
    diff = res["difference"]
    assert diff["kind"] == replay.SAME_ARGUMENTS and diff["paired_by"] == "same arguments", diff
    _fresh_run_exits_1(res)


def _move_weight(linear: torch.nn.Linear, floats: int) -> None:
    """The same weight values at another address: `floats` elements into a fresh buffer."""
    w = linear.weight.detach()
    buf = torch.empty(w.numel() + floats)
    moved = buf[floats:].view_as(w)
    moved.copy_(w)
    linear.weight = torch.nn.Parameter(moved, requires_grad=False)


def _aten_gemm_follows_alignment(linear: torch.nn.Linear) -> bool:
    """Whether this CPU's GEMV gives other bits for the same weight 4 bytes further on (AVX2 paths do; some
    AVX-512/AMX paths do not), on a few rows of the layer's own input size."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 1, linear.in_features, generator=g)
    w = linear.weight.detach()
    buf = torch.empty(w.numel() + 1)
    moved = buf[1:].view_as(w)
    moved.copy_(w)
    return any(not torch.equal(F.linear(r, w), F.linear(r, moved)) for r in x)


@pytest.mark.parametrize("gemm", ["aten", "stand-in"])
def test_a_gemm_on_a_misaligned_weight_is_reproduced_with_its_alignment(pair, tmp_path, gemm):
    """Side B's o_proj weight holds the same bits 4 bytes further on: a GEMV kernel takes another path (the CPU's
    own where its ISA does, else plant_kernels.linear, whose reduction follows the weight's address on any CPU).
    The repro rebuilds each argument's alignment in the fresh process, so it reproduces, and names the alignment."""
    a, b = pair
    o_proj = b.model.model.layers[1].self_attn.o_proj
    operator = "aten.linear.default"
    if gemm == "stand-in":
        for m in (a.model, b.model):
            m._tic_provider.linear = plant_kernels.linear
        operator = "plant_kernels.linear.default"
    elif not _aten_gemm_follows_alignment(o_proj):
        pytest.skip(f"this CPU's GEMV ({torch.backends.cpu.get_cpu_capability()}) ignores the weight's alignment")
    _move_weight(o_proj, 1)
    found = locate(*sides(a, b), tmp_path / "out", "plant", 2)
    res = report.write(found, tmp_path / "out")
    assert res["culprit_module"] == "model.layers.1.self_attn.o_proj", res["module_trail"]
    assert res["first_operator"] == operator
    diff = res["difference"]
    assert diff["kind"] == replay.SAME_ARGUMENTS, diff
    assert "argument 1 (weight)'s address mod 64 bytes" in diff["detail"], diff
    _fresh_run_exits_1(res)
    _move_weight(o_proj, 0)  # the plant removed: side B's weight aligned as side A's
    again = recheck_repro(*sides(a, b), found, "B", tmp_path / "aligned")
    assert again["kind"] == "operator" and again["exit_code"] == 0, again


def test_a_float64_gemm_is_named_with_the_argument_that_differs(pair, tmp_path):
    """Side B's o_proj runs its GEMM in float64 (both sides run aten.linear): the operator is the linear, the
    verdict an argument that differs (its dtype), with where each side's argument came from."""
    a, b = pair
    o_proj = b.model.model.layers[1].self_attn.o_proj
    o_proj.forward = lambda x, w=o_proj.weight: F.linear(x.double(), w.double()).to(x.dtype)
    res = locate_pair(a, b, tmp_path / "out")
    assert res["culprit_module"] == "model.layers.1.self_attn.o_proj"
    assert res["first_operator"] == "aten.linear.default"
    diff = res["difference"]
    assert diff["kind"] == replay.ARGUMENTS_DIFFER and diff["argument"] == 0, diff
    assert diff["detail"] == "argument 0 (input): the traced token's part is float32 on side A, float64 on side B"
    assert diff["origins"]["B"].endswith("(aten.to.dtype)") and diff["origins"]["A"].endswith("the module's input")
    _fresh_run_exits_1(res)


def test_a_multiply_by_a_constant_inside_attention_stays_the_named_operator(pair, tmp_path):
    """Side B's attention scales its output by a constant; side A runs aten.mul too (rotary), so a summary of the
    operators only one side runs would name none of it: the operator found is the multiply."""
    a, b = pair
    attn = b.model.model.layers[1].self_attn
    inner = attn.forward

    def scaled(*args, **kwargs):
        out = inner(*args, **kwargs)
        return (out[0] * 1.0001,) + tuple(out[1:])

    attn.forward = scaled
    res = locate_pair(a, b, tmp_path / "out")
    assert res["culprit_module"] == "model.layers.1.self_attn", res["module_trail"]
    assert res["first_operator"] == "aten.mul.Tensor"
    diff = res["difference"]
    assert diff["kind"] == replay.SEQUENCES_DIFFER and diff["calls"]["B"]["operator"] == "aten.mul.Tensor", diff
    assert "1.0001" in diff["calls"]["B"]["args"]
    _fresh_run_exits_1(res)  # both sides' module replayed from the same input


def test_a_rounding_before_a_cat_of_two_traced_tensors_is_found_on_its_side(pair, tmp_path):
    """Side A rounds the gate projection through bfloat16 before concatenating it with the up projection. Side B's
    first new value is its cat, whose counterpart (side A's cat) has inputs side B never has: that is seen only if
    the cat's list of inputs is traced, and the search goes on from side A to its rounding."""
    a, b = pair
    mlp = a.model.model.layers[1].mlp

    def forward(self, x):
        g, u = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self._tic_ops.silu_and_mul(torch.cat([g.to(torch.bfloat16).to(g.dtype), u], dim=-1)))

    mlp.forward = types.MethodType(forward, mlp)
    res = locate_pair(a, b, tmp_path / "out")
    assert res["culprit_module"] == "model.layers.1.mlp", res["module_trail"]
    assert res["operator_side"] == "A" and res["first_operator"] in ("aten.to.dtype", "aten._to_copy.default"), res
    _fresh_run_exits_1(res)


def test_a_forward_pairing_given_up_for_side_a_is_named_in_the_verdict(pair, tmp_path):
    """Side A's norm writes into a buffer that already holds a value (a product of its input), side B's into a
    fresh one. Side B's norm pairs with side A's on the same arguments, but side A's call reads a value side B never
    has, so the search goes on from side A and names its multiply. The verdict also says why the first pairing was
    given up, naming the argument: without that, a reverse search that finds no pair leaves no trace of it."""
    def rows_norm(fill: bool):
        def norm(x, w, eps):
            rows = x.reshape(-1, x.shape[-1])
            out = rows * 0.5 if fill else torch.empty(rows.shape, dtype=rows.dtype)
            torch.ops.plant_kernels.rms_norm(out, rows, w, eps)
            return out.reshape(x.shape)
        return norm

    a, b = pair
    a.model._tic_provider.rms_norm = rows_norm(True)
    b.model._tic_provider.rms_norm = rows_norm(False)
    res = locate_pair(a, b, tmp_path / "out")
    diff = res["difference"]
    assert res["first_operator"] == "aten.mul.Tensor" and diff["kind"] == replay.SEQUENCES_DIFFER, diff
    assert "side B's own plant_kernels.rms_norm.default (its call" in diff["detail"], diff
    assert "traced input in argument 0 (result) is a value side B never has" in diff["detail"], diff
