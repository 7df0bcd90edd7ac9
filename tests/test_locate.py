"""The locator: planted divergences on one side are found at exactly the planted layer, module and operator,
with a repro that reproduces in a fresh process; a control with nothing planted reports no divergence; and
the embedded default's real C4/C5 failures are localised through the runner."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tic.harness.kernels.consistent_cpu import rowwise
from tic.config.schema import load_config
from tic.skill.context import GateContext

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
from tic_locate_pair import engines, locate_pair  # noqa: E402
DENSE = ROOT / "examples" / "tiny-qwen3"
MOE = ROOT / "examples" / "tiny-qwen3-moe"


def _engines(example: Path):
    return engines(example / "tic-consistent.yaml")


_run = locate_pair


def _check_repro(res: dict):
    """The emitter already ran the script in a fresh interpreter; it must have exited 1 there."""
    assert res["repro"] and res["repro_check"]["reproduces"], res.get("repro_check")
    assert res["repro_check"]["exit_code"] == 1 and "ulp" in res["repro_check"]["output"]
    assert Path(res["repro"]).is_file() and Path(res["repro_check"]["tensors"]).is_file()


def plant_eps(model):
    model.model.layers[2].post_attention_layernorm.variance_epsilon = 1e-5


def plant_reduction_order(model):
    down = model.model.layers[1].mlp.down_proj
    h = down.weight.shape[1] // 2

    def split_k(self, x):  # the same dot products, summed as two halves
        w = self.weight
        return rowwise(lambda r: F.linear(r[:, :h], w[:, :h]) + F.linear(r[:, h:], w[:, h:]), x)

    down.forward = types.MethodType(split_k, down)


def plant_bf16_intermediate(model):
    down = model.model.layers[3].mlp.down_proj
    inner = down.forward
    down.forward = lambda x: inner(x.to(torch.bfloat16).to(x.dtype))  # its input (SiLU*mul) rounded to bf16


PLANTS = [
    (plant_eps, "model.layers.2", "model.layers.2.post_attention_layernorm", {"aten.add.Tensor"}),
    (plant_reduction_order, "model.layers.1", "model.layers.1.mlp.down_proj",
     {"aten.linear.default", "aten.mm.default", "aten.addmm.default"}),
    (plant_bf16_intermediate, "model.layers.3", "model.layers.3.mlp.down_proj",
     {"aten.to.dtype", "aten._to_copy.default"}),
]


@pytest.mark.parametrize("plant,layer,module,ops", PLANTS, ids=[p[0].__name__ for p in PLANTS])
def test_planted_divergence_is_localised(tmp_path, monkeypatch, plant, layer, module, ops):
    monkeypatch.chdir(tmp_path)
    a, b = _engines(DENSE)
    plant(b.model)
    res = _run(a, b, tmp_path / "out")
    assert res["status"] == "localized", res["status"]
    assert res["first_divergent_layer"] == layer
    assert res["culprit_module"] == module
    assert res["first_operator"] in ops
    _check_repro(res)
    assert Path(res["chart"]).read_bytes()[:4] == b"\x89PNG"
    assert "first divergent" in Path(res["report"]).read_text()


def test_planted_moe_tie_break(tmp_path, monkeypatch):
    """Three experts tied in one router; side B breaks ties towards the higher index."""
    monkeypatch.chdir(tmp_path)
    a, b = _engines(MOE)
    for m in (a.model, b.model):
        w = m.model.layers[2].mlp.gate.weight
        w[1:3] = w[0]
        w[0:3] *= 8  # the tied experts win, so the tie decides which two are chosen
    blk = b.model.model.layers[2].mlp
    orig_sort = torch.sort

    def sort_high_index_first(x, dim=-1, **kw):  # the router's top-k is a stable descending sort
        v, i = orig_sort(x.flip(dim), dim=dim, **kw)
        return torch.return_types.sort((v, x.shape[dim] - 1 - i))

    fwd = blk.forward

    def planted(hidden):
        torch.sort = sort_high_index_first
        try:
            return fwd(hidden)
        finally:
            torch.sort = orig_sort

    blk.forward = planted
    res = _run(a, b, tmp_path / "out", upto=1)
    assert res["first_divergent_layer"] == "model.layers.2"
    assert res["culprit_module"] == "model.layers.2.mlp"
    # side B's extra flip is its first value side A never computes: named, with its kind of difference
    assert res["first_operator"] == "aten.flip.default", res["first_operator"]
    assert res["difference"]["kind"] == "different operator sequences", res["difference"]
    _check_repro(res)
    # the flip has no counterpart on side A: the repro replays both sides' whole mlp, not flip alone
    assert res["status"].startswith("localized: different operator sequences in model.layers.2.mlp"), res["status"]
    script = Path(res["repro"]).read_text()
    assert "Module: model.layers.2.mlp, replayed as each side's recorded operator sequence" in script
    # the replay must give each side's recorded value: a program that does not is a broken repro (exit 3)
    data = torch.load(res["repro_check"]["tensors"], weights_only=False)
    data["a"]["recorded"] = data["a"]["recorded"] + 1
    torch.save(data, res["repro_check"]["tensors"])
    proc = subprocess.run([sys.executable, res["repro"]], capture_output=True, text=True)
    assert proc.returncode == 3 and "does not give the value it recorded" in proc.stdout, proc.stdout


def test_control_reports_no_divergence(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a, b = _engines(DENSE)
    res = _run(a, b, tmp_path / "out")
    assert res["status"] == "no divergence"
    assert res["first_divergent_layer"] is None and res["repro"] is None
    assert all(r["equal"] for r in res["layers"])


def test_embedded_default_c4_c5_localised(tmp_path, monkeypatch):
    """Stock kernels: the ladder's C4/C5 failures carry a named layer, operator and a small working repro."""
    from tic.skill.runner import run_ladder

    monkeypatch.chdir(tmp_path)
    cfg = load_config(DENSE / "tic.yaml")
    cfg.state_dir = tmp_path / ".tic"  # .tic/ would otherwise go beside the repository's tic.yaml
    results = run_ladder(GateContext(cfg), "C4", "C5", keep_going=True)
    assert [r.verdict for r in results] == ["fail", "fail"]
    for gate in ("C4", "C5"):
        rec = json.loads((tmp_path / ".tic" / "results" / f"{gate}.json").read_text())
        loc = rec["details"]["locate"]
        assert loc["status"] == "localized", loc
        assert loc["first_divergent_layer"].startswith("model.layers.")
        assert loc["culprit_module"] and loc["first_operator"].startswith("aten.")
        assert loc["reproduced_gate_values"] is True
        assert loc["repro_check"]["reproduces"] and loc["repro_check"]["rows_b"] <= 8
        assert any(e.endswith("repro.py") for e in rec["evidence"])
    # and once more, by hand, in a fresh process with only torch needed
    out = subprocess.run([sys.executable, "-I", loc["repro"]], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr


def test_readme_example_c3_is_located_with_a_repro_that_exits_1(example, monkeypatch, tic):
    """`tic locate --gate C3` on the README's embedded example: the probe alone and inside a batch of 2 run q_proj's
    GEMM on 1 and 2 rows. The traced token's row is the same on both sides; the repro replays both GEMMs (it used
    to compare a [1, D] pick with a [D] pick while shrinking, cut side B to one row, and then found no
    difference), says the row count is what differs, and exits 1 in a fresh process."""
    import json

    cfg = example("tiny-qwen3") / "tic.yaml"
    monkeypatch.chdir(cfg.parent)
    code, out, _ = tic("locate", "-c", str(cfg), "--gate", "C3", "--json")
    found = json.loads(out)
    assert code == 1 and found["culprit_module"] and found["first_operator"] == "aten.linear.default", found
    assert found["difference"]["kind"] == "same operator, the traced token's arguments bit-identical, different bits"
    assert "rows)" in found["difference"]["detail"], found["difference"]
    assert found["repro"], found["repro_check"]
    proc = subprocess.run([sys.executable, "-I", found["repro"]], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "PROVES: same operator" in proc.stdout, proc.stdout + proc.stderr


def test_locate_command_bad_gate(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    from tic.skill.cli import main

    with pytest.raises(SystemExit) as e:
        main(["locate", "-c", str(DENSE / "tic.yaml"), "--gate", "C9"])
    assert e.value.code == 2
    assert "C3, C4, C5 or C6" in capsys.readouterr().err


def test_gate_without_mismatch_is_not_localised_but_does_not_raise(tmp_path, monkeypatch):
    from tic.gates.base import Measurement
    from tic.harness.locate.search import locate_for_gate

    monkeypatch.chdir(tmp_path)
    cfg = load_config(DENSE / "tic.yaml")
    cfg.state_dir = tmp_path / ".tic"
    ctx = GateContext(cfg)
    got = locate_for_gate(ctx, "C5", Measurement(metrics={"first_mismatch": None}))
    assert got["status"].startswith("not localised")
    got = locate_for_gate(ctx, "C9", Measurement(metrics={"first_mismatch": {"sequence": 0, "position": 0}}))
    assert "no locator recipe" in got["status"]


def test_a_broken_locator_keeps_the_verdict_and_says_where_it_broke(tmp_path, monkeypatch):
    import tic.harness.locate.search as locate_mod
    from tic.gates.base import Gate, Judgement, Measurement
    from tic.skill.runner import run_gate

    def broken(ctx, gate_id, measured, strict=False):
        raise RuntimeError("Unable to cast Python instance")

    monkeypatch.setattr(locate_mod, "locate_for_gate", broken)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(DENSE / "tic.yaml")
    cfg.state_dir = tmp_path / ".tic"
    gate = Gate(id="C5", title="t", step=3, measures="", pass_condition="", inputs=[], artifacts=[], guide="",
                measure=lambda ctx: Measurement(), judge=lambda m: Judgement("fail", "planted", "x"),
                locate_on_fail=True)
    res = run_gate(gate, GateContext(cfg), save=False)
    assert res.verdict == "fail"
    status = res.details["locate"]["status"]
    assert status.startswith("locator error: RuntimeError: Unable to cast Python instance (at ")
    assert "broken" in status  # the innermost frame: where it broke


def _mm_side(op_name: str):
    from tic.harness.locate.trail import OpCall
    from tic.harness.locate.repro import OpSide

    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    w = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    out = torch.ops.aten.mm.default(x, w)
    call = OpCall(op=op_name, func=torch.ops.aten.mm.default, args=(x, w), kwargs={}, outputs=(out,))
    return OpSide(call=call, where={"kind": "row", "output": 0, "row": 1}, rows=3), out[1]


def test_repro_is_emitted_only_when_the_script_itself_says_it_differs(tmp_path):
    from tic.harness.locate.repro import emit

    side, value = _mm_side("aten.mm.default")
    planted = value.clone()
    planted[0] = torch.nextafter(planted[0], torch.tensor(float("inf")))
    ok = emit(tmp_path / "ok", "C5", None, side, planted, "a", "b", "planted one-ulp difference")
    assert ok["reproduces"] and ok["exit_code"] == 1 and (tmp_path / "ok" / "repro.py").is_file()
    # control: the same value on both sides is not a repro
    same = emit(tmp_path / "same", "C5", None, side, value.clone(), "a", "b", "no difference")
    assert not same["reproduces"] and same["exit_code"] == 0
    # a script that crashes in a fresh process (its op cannot be resolved there) must not count as reproducing
    broken, _ = _mm_side("aten.no_such_operator.default")
    bad = emit(tmp_path / "bad", "C5", None, broken, planted, "a", "b", "unresolvable op")
    assert not bad["reproduces"] and bad["exit_code"] == 3
    assert not (tmp_path / "bad" / "repro.py").exists()


def test_value_key_of_a_strided_size_one_view():
    """An int64 row cut from [N, k] routing ids is a size-1 view with stride k; its bytes are still its key."""
    from tic.harness.locate.search import _key

    t = torch.empty_strided((1,), (3,), dtype=torch.long).fill_(7)
    assert _key(t) == _key(torch.tensor([7]))


def test_two_sides_calls_pair_by_the_size_of_the_tokens_value_not_its_shape():
    """Side A's kernel gives the traced token one row [H, D]; side B's, on another layout, gives the same H*D
    elements scattered through its output (a mask of elements, taken flat). They are the same step: the first
    operator is named with side A's call as its counterpart, not as "implementations differ"."""
    from tic.harness.locate.trail import OpCall, Trail
    from tic.harness.locate.search import first_operator

    H, D, f = 2, 3, 1  # one sequence of 2 tokens (B=1, T=2); the traced token is the second
    x = torch.randn(2, H, D, generator=torch.Generator().manual_seed(0))
    out_a = x * 2
    tok_a = torch.tensor([0, 1], dtype=torch.int32)[:, None, None].expand(2, H, D).clone()
    out_b = (x * 2).permute(1, 0, 2).reshape(2 * H, D).clone()  # rows of heads: token 1 spans rows 1 and 3
    out_b[1, 0] += 1e-3  # the plant: one element of token 1 differs on side B
    tok_b = tok_a.permute(1, 0, 2).reshape(2 * H, D).clone()
    op = torch.ops.aten.mul.Tensor
    a = Trail(calls=[OpCall("aten.mul.Tensor", op, (x, 2), {}, (out_a,), None, (tok_a,), (tok_a,))],
              batch=1, length=2, flat_index=f)
    b = Trail(calls=[OpCall("aten.mul.Tensor", op, (x, 2), {}, (out_b,), None, (tok_b,), (tok_a,))],
              batch=1, length=2, flat_index=f)
    found = first_operator(a, b)["found"]
    assert found is not None and found["op"] == "aten.mul.Tensor"
    assert found["a_call"] == 0 and found["b_where"]["kind"] == "mask" and found["a_where"]["kind"] == "row"
    assert not found.get("sequences_differ")


def test_identical_operator_sequences_never_end_in_different_operators():
    """Both sides run one mul; side B's trail knows the traced token for part of its row only (a value of another
    size), so no step pairs by size. The two sides' operator sequences are the same: the calls at the same place
    are the pair, and the verdict is about their arguments, never "different operator sequences"."""
    from tic.harness.locate.trail import OpCall, Trail
    from tic.harness.locate.search import first_operator, operator_difference

    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    op = torch.ops.aten.mul.Tensor
    tok = torch.tensor([0, 1], dtype=torch.int32)[:, None].expand(2, 4).clone()
    part = tok.clone()
    part[1, 2:] = -1  # side B: the traced token's last two elements not known as its own
    a = Trail([OpCall("aten.mul.Tensor", op, (x, 2.0), {}, (x * 2,), None, (tok,), (tok,))], 1, 2, 1)
    b = Trail([OpCall("aten.mul.Tensor", op, (x, 2.5), {}, (x * 2.5,), None, (part,), (tok,))], 1, 2, 1)
    found = first_operator(a, b)["found"]
    assert found["a_call"] == 0 and found["paired_by"] == "same sequence", found
    diff = operator_difference(found, a, b, "A", "B")
    assert diff.kind == "same operator, arguments that differ" and diff.argument == 1, diff


def test_a_counterpart_that_records_no_value_for_the_token_is_named_with_why():
    """Both sides run one norm, but side A's trail maps its output to no token (a kernel writing into a buffer
    the recorder does not trace back to the token), so nothing pairs with side B's call. The verdict says which
    of side A's calls of that operator there were and why none of them is the counterpart."""
    from tic.harness.locate.trail import OpCall, Trail
    from tic.harness.locate.search import first_operator, operator_difference

    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    op = torch.ops.aten.mul.Tensor
    tok = torch.tensor([0, 1], dtype=torch.int32)[:, None].expand(2, 4).clone()
    none = torch.full_like(tok, -1)
    a = Trail([OpCall("aten.mul.Tensor", op, (x, 2.0), {}, (x * 2,), None, (none,), (tok,))], 1, 2, 1)
    b = Trail([OpCall("aten.mul.Tensor", op, (x, 2.5), {}, (x * 2.5,), None, (tok,), (tok,))], 1, 2, 1)
    found = first_operator(a, b)["found"]
    assert found["a_call"] is None and found.get("sequences_differ"), found
    diff = operator_difference(found, a, b, "A", "B")
    assert diff.kind == "different operator sequences"
    assert "side A's aten.mul.Tensor calls: call 1 (float32[2, 4], 2.0): no value for the traced token in any " \
           "output" in diff.detail, diff.detail


def test_without_matplotlib_the_report_says_there_is_no_chart(tmp_path, monkeypatch):
    """The chart is the `chart` extra: without matplotlib, no divergence.png, and one note in report.md."""
    import sys

    from tic.harness.locate import report

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    table = [{"stage": "model.layers.0", "max_ulp": 3, "equal": False, "first_divergent": True}]
    assert report.write_chart(tmp_path / "divergence.png", table, "C5") == ""
    assert not (tmp_path / "divergence.png").exists()
    # (with matplotlib the chart is a PNG: test_planted_divergence_is_localised)


def test_children_of_a_module_sharing_a_submodule():
    """vLLM builds one rotary embedding per configuration and shares it across layers: named_modules() lists it
    under layer 0 only, so the locator's walk below layer 1 must not look the shared path up (it raised
    KeyError on Gemma in vLLM)."""
    from torch import nn

    from tic.harness.locate.capture import module_children

    rope = nn.Identity()
    layers = nn.ModuleList()
    for _ in range(2):
        attn = nn.Module()
        attn.q_proj, attn.rotary_emb = nn.Linear(2, 2), rope
        layer = nn.Module()
        layer.self_attn = attn
        layers.append(layer)
    modules = dict(nn.ModuleDict({"layers": layers}).named_modules())
    assert module_children(modules, "layers.0.self_attn") == ["layers.0.self_attn.q_proj",
                                                              "layers.0.self_attn.rotary_emb"]
    assert module_children(modules, "layers.1.self_attn") == ["layers.1.self_attn.q_proj"]


def test_first_divergent_stage_skips_a_difference_that_a_later_stage_no_longer_shows():
    """An operation the two models place in different modules (an embedding scale inside one side's embedding,
    after the other's) makes that stage differ while the next agrees: the divergence is the later one that
    reaches the output."""
    from tic.harness.locate.capture import Capture
    from tic.harness.locate.search import compare_stages

    row = lambda v: {0: (torch.full((4,), v),), 1: (torch.full((4,), v + 1),)}  # noqa: E731
    stages = ["embed", "layers.0", "layers.1", "layers.2"]
    a = Capture(outputs={s: row(v) for s, v in zip(stages, (1.0, 2.0, 3.0, 4.0))})
    b = Capture(outputs={s: row(v) for s, v in zip(stages, (8.0, 2.0, 3.5, 4.5))})
    table, first = compare_stages(stages, a, b)
    assert first == "layers.1"
    assert [r["equal"] for r in table] == [False, True, False, False]
    assert [r["first_divergent"] for r in table] == [False, False, True, False]
    # a divergence that reaches the output from the first stage on is still the first stage
    c = Capture(outputs={s: row(v) for s, v in zip(stages, (8.0, 9.0, 3.5, 4.5))})
    assert compare_stages(stages, a, c)[1] == "embed"
    assert compare_stages(stages, a, a)[1] is None


def test_model_level_parts_are_found_by_convention_or_by_class(example):
    """embed_tokens / norm where a model has them, else the child of that kind (Mamba-2: embeddings, norm_f): the
    vLLM capture maps a forward step's rows at the embedding's call, so a model without embed_tokens must still
    name one."""
    from tic.config.schema import load_config
    from tic.harness.engines import hf
    from tic.harness.locate.capture import model_part
    from tic.skill.context import GateContext

    for name, prefix, want in (("tiny-mamba2", "backbone", ("backbone.embeddings", "backbone.norm_f")),
                               ("tiny-qwen3", "model", ("model.embed_tokens", "model.norm"))):
        d = GateContext(load_config(example(name) / "tic.yaml" if name == "tiny-qwen3"
                                    else example(name) / "tic-consistent.yaml")).model.dir
        modules = dict(hf.load_model(d, "float32", kernels="stock", shared=False).named_modules())
        got = (model_part(modules, prefix, "embed_tokens", "Embedding"), model_part(modules, prefix, "norm", "Norm"))
        assert got == want
    assert model_part({"model": torch.nn.Module()}, "model", "embed_tokens", "Embedding") is None


def test_a_nan_made_in_training_is_located_to_its_module_and_operator(example, workdir):
    """C5 with a NaN planted in one weight of layer 2 after the rollout sampled: the training recompute's logprob is
    NaN, the gate fails on it and the record names layer 2's module and the operator that made the NaN from
    finite inputs; the control, before the plant, finds nothing to search."""
    from tic.config.schema import load_config
    from tic.gates import get
    from tic.harness.engines import hf
    from tic.harness.locate.nonfinite import first_nonfinite
    from tic.skill.context import GateContext
    from tic.skill.runner import run_gate

    hf._MODELS.clear()
    cfg = load_config(example("tiny-qwen3") / "tic-consistent.yaml")
    cfg.prompts.count, cfg.sampling.max_tokens = 3, 4
    ctx = GateContext(cfg)
    model = ctx.train_engine().model
    ids = torch.tensor([ctx.rollout_samples()[0].ids])
    assert first_nonfinite(model, lambda: model(input_ids=ids, use_cache=False))["status"].startswith("no module")
    with torch.no_grad():
        model.model.layers[2].mlp.down_proj.weight[0, 0] = float("nan")
    try:
        res = run_gate(get("C5"), ctx, save=False)
    finally:
        hf._MODELS.clear()
    assert res.verdict == "fail" and res.key_figure == "NaN/Inf"
    found = res.details["locate"]
    assert found["status"] == "localized" and found["side"] == "train", found
    assert found["module"].startswith("model.layers.2.mlp"), found
    assert found["operator"] is not None and found["operator_arguments_finite"] is False, found  # the weight


def _vllm_rollout_config(tmp_path, options: str):
    """examples/vllm's config with other rollout options (read only: no vLLM is needed to load it)."""
    text = (ROOT / "examples" / "vllm" / "tic.yaml").read_text()
    head, rest = text.split("  options:\n", 1)
    rest = rest[rest.index("  patches:"):]
    (tmp_path / "config.json").write_text((ROOT / "examples" / "vllm" / "config.json").read_text())
    (tmp_path / "tic.yaml").write_text(head + f"  options: {options}\n" + rest)
    return load_config(tmp_path / "tic.yaml")


def test_locate_eager_runs_a_compiled_vllm_rollout_eagerly_and_keeps_what_sets_its_kernels(tmp_path):
    """`tic locate --eager` on a rollout in vLLM's compiled mode: torch.compile and CUDA graphs off, in this
    process (what the capture runner requires), while the patches, the IR op priorities and custom_ops (which
    choose the kernels, hence the bits) stay. An eager rollout is left unchanged (the control)."""
    from tic.harness.engines.vllm import OPTIONS
    from tic.skill.locate_cmd import eager_rollout

    compiled = _vllm_rollout_config(tmp_path, "{enforce_eager: false, compilation_config: {mode: 3, custom_ops: [all]}, "
                                    "cudagraph_mode: FULL_AND_PIECEWISE, ir_op_priority: {rms_norm: [vllm_c]}, "
                                    "engine_process: own, max_model_len: 512}")
    cfg, note = eager_rollout(compiled)
    o = {**OPTIONS, **cfg.rollout.options}
    assert o["enforce_eager"] is True and o["engine_process"] == "inline" and o["cudagraph_mode"] is None
    assert o["compilation_config"] == {"mode": 0, "custom_ops": ["all"], "cudagraph_mode": "NONE"}
    assert o["ir_op_priority"] == {"rms_norm": ["vllm_c"]} and o["max_model_len"] == 512
    assert o["model_runner"] == "v1"  # the runner whose step layout the capture maps (vLLM picks V2 for dense)
    assert cfg.rollout.patches == compiled.rollout.patches and cfg.train == compiled.train
    assert "enforce_eager: True" in note and "model_runner: v1" in note and "not rewritten" in note
    assert compiled.rollout.options["enforce_eager"] is False  # the loaded config itself is not changed

    eager_v2 = _vllm_rollout_config(tmp_path, "{enforce_eager: true, max_model_len: 512}")
    pinned, note = eager_rollout(eager_v2)
    assert pinned.rollout.options["model_runner"] == "v1"
    assert note.startswith("--eager: rollout.options model_runner: v1 for this run")  # eager already: only that
    eager = _vllm_rollout_config(tmp_path, "{enforce_eager: true, model_runner: v1, max_model_len: 512}")
    same, note = eager_rollout(eager)
    assert same is eager and "nothing changed" in note
    hf, note = eager_rollout(load_config(DENSE / "tic.yaml"))
    assert hf.rollout == load_config(DENSE / "tic.yaml").rollout and "(hf) runs eagerly already" in note


def test_capture_refusal_on_a_compiled_vllm_rollout_names_the_eager_rerun():
    """The line a gate's locate record keeps when its rollout was compiled says how to localise it anyway."""
    from tic.harness.locate.vllm_capture import VLLMCaptureRunner

    class Compiled:
        opts = {"enforce_eager": False, "engine_process": "inline"}

    with pytest.raises(Exception) as e:
        VLLMCaptureRunner(Compiled())
    assert "tic locate --eager" in str(e.value)


def test_locate_eager_on_an_eager_rollout_says_so_and_localises_as_without(example, monkeypatch, tic):
    cfg = example("tiny-qwen3") / "tic.yaml"
    monkeypatch.chdir(cfg.parent)
    code, out, err = tic("locate", "-c", str(cfg), "--gate", "C3", "--eager", "--json")
    assert code == 1 and json.loads(out)["culprit_module"], out
    assert "--eager: the rollout (hf) runs eagerly already" in err


def test_locate_eager_on_an_eager_rollout_that_passes_clears_the_old_report_as_without(example, monkeypatch, tic):
    """The configured mode is eager here, so a pass under --eager is the gate's own pass: the last failure's report
    goes, and no compiled-code hint is printed."""
    cfg = example("tiny-qwen3") / "tic-consistent.yaml"
    monkeypatch.chdir(cfg.parent)
    stale = cfg.parent / ".tic-consistent" / "artifacts" / "C3" / "locate"
    stale.mkdir(parents=True)
    (stale / "report.md").write_text("an earlier failure\n")
    code, _, err = tic("locate", "-c", str(cfg), "--gate", "C3", "--eager")
    assert code == 0 and "passes" in err and "compiled code" not in err, err
    assert not stale.exists()


def test_locate_eager_report_says_what_the_run_changed(example, monkeypatch, tic):
    """A report written under --eager says which rollout options that run changed (report.md, locate.json, the
    gate's summary), so that a reader of the files alone knows they are not of the configured mode; a report
    of a run as configured says nothing of the kind (the control)."""
    import tic.skill.locate_cmd as locate_cmd

    cfg = example("tiny-qwen3") / "tic.yaml"
    monkeypatch.chdir(cfg.parent)
    code, out, _ = tic("locate", "-c", str(cfg), "--gate", "C3", "--json")
    assert code == 1 and json.loads(out)["run_changes"] is None
    assert "not the configuration as written" not in Path(json.loads(out)["report"]).read_text()

    changed = "--eager: rollout.options enforce_eager: True for this run (the gate's record is not rewritten)"
    monkeypatch.setattr(locate_cmd, "eager_rollout", lambda c: (c.model_copy(), changed))  # as vLLM's would
    code, out, err = tic("locate", "-c", str(cfg), "--gate", "C3", "--eager", "--json")
    found = json.loads(out)
    assert code == 1 and found["culprit_module"] and found["run_changes"] == changed, out
    assert f"this run, not the configuration as written: {changed}" in Path(found["report"]).read_text()
    assert json.loads((Path(found["report"]).parent / "locate.json").read_text())["run_changes"] == changed
