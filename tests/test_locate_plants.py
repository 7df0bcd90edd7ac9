"""Generative check of the locator, seeded subset (the full set: benchmarks/bench_locate_plants.py).

Each seed draws a tiny model of some family, its kernels (tic's wrappers or stock), a compared sequence and
layouts, and one plant at a random module (on one side, or on both for a kernel that follows its launch's rows);
the locator must name the plant's layer, module and operator, with a repro that exits 1, and that same repro,
rerun with the plant removed (the planted side's entry recorded anew), must exit 0. Controls (nothing planted;
the same plant on both sides) must report no divergence and emit no repro."""

from __future__ import annotations

import pytest
import torch

from tic.harness.testing.plants import draw_plant, operator_named, run_trial

# Plant seeds, each a kind of difference on a family and kernels. Whether a plant changes any output bit can follow
# the CPU's GEMM kernels (a column-major or float64 weight on AVX2 vs AVX-512/AMX paths), so each kind lists seeds of
# that kind in order: the first whose plant reaches the output on this CPU is the one located. A kind none of whose
# seeds reaches the output here is skipped, naming the CPU capability; a crash or a wrong verdict always fails.
#   1004 a per-head norm (gemma3_text q/k norms on [B, H, T, D]) on stock kernels;
#   1011, 19, 29: a GEMM in float64 on stock kernels (an argument that differs);
#   1021 a rounding before a cat of two traced tensors (wrappers); 1034 a scale moved across the residual add
#   inside an add+RMSNorm; 1039 a norm kernel whose reduction follows its launch's row count, on both sides (the
#   same operator on the traced token's bit-identical arguments); 1049 a GEMM weight made column-major (the same
#   values, other strides); 1000 an attention kernel over the whole launch on both sides;
#   5, 100009, 100039: a weight column-major on stock kernels (5: lm_head's, whose repro is cut to fewer rows: the
#   rerun without the plant must cut the new call alike, as a stock GEMM's bits follow its row count)
PLANT_KINDS = {"per-head norm": [1004], "float64 GEMM (stock)": [1011, 19, 29], "rounding before a cat": [1021],
               "scale across the residual add": [1034], "norm following its row count": [1039],
               "column-major weight (wrappers)": [1049], "attention over the whole launch": [1000],
               "column-major weight (stock)": [5, 100009, 100039]}
INEFFECTIVE = ("ineffective", "absorbed")


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.mark.parametrize("kind", PLANT_KINDS)
def test_plant_is_located_with_a_repro(tmp_path, monkeypatch, kind):
    monkeypatch.chdir(tmp_path)
    tried = []
    for seed in PLANT_KINDS[kind]:
        r = run_trial(seed, tmp_path / f"out-{seed}")
        if r["status"] not in INEFFECTIVE:
            break
        tried.append(f"{seed}: {r['status']}")
    else:
        pytest.skip(f"no seed's plant reaches the output on this CPU ({torch.backends.cpu.get_cpu_capability()}): "
                    + ", ".join(tried))
    assert r["status"] != "crash", r
    assert r["layer_right"] and r["module_right"], r
    assert r["operator_right"], r
    assert r["repro_exit"] == 1, r
    assert r["repro_exit_without_plant"] == 0, r


# seed 1003: an operator repro (eps: aten.add on another scalar); seed 1002: a module repro (a multiply by a
# constant at the end of attention)
@pytest.mark.parametrize("seed,kind", [(1003, "operator"), (1002, "module")])
def test_recheck_without_plant_can_fail(tmp_path, monkeypatch, seed, kind):
    """The rerun that must exit 0 without the plant exits 1 when the plant is left in: it is no formality."""
    monkeypatch.chdir(tmp_path)
    r = run_trial(seed, tmp_path / "out", remove_plant_for_recheck=False)
    assert r["repro_exit"] == 1, r
    assert r["repro_without_plant_kind"] == kind, r
    assert r["repro_exit_without_plant"] == 1, r


@pytest.mark.parametrize("seed,mode", [(1020, "clean"), (1010, "symmetric")])
def test_controls_stay_clean(tmp_path, monkeypatch, seed, mode):
    monkeypatch.chdir(tmp_path)
    r = run_trial(seed, tmp_path / "out", mode=mode)
    assert r["clean"], r
    assert r["repro_exit"] is None


def test_plant_changes_only_its_side_and_uninstalls():
    """A plant wraps one module of one model; removing it gives the model's own bits back."""
    import random

    from tic.harness.testing.tinymodels import tiny_model
    from tic.harness.engines.hf import load_model
    import copy

    model_dir, _ = tiny_model(3, "llama")
    base = load_model(model_dir, "float32", "consistent")
    model = copy.deepcopy(base)
    plant = draw_plant(model, random.Random(7), "b", branches=False)
    ids = torch.tensor([[5, 9, 11, 4]])
    with torch.inference_mode():
        clean = model(input_ids=ids).logits.clone()
        undo = plant.install(model)
        planted = model(input_ids=ids).logits.clone()
        undo()
        again = model(input_ids=ids).logits.clone()
    assert torch.equal(clean, again)
    assert plant.module in dict(model.named_modules())
    assert planted.shape == clean.shape


def test_operator_answer_matching():
    assert operator_named("aten.add.Tensor", ("aten.add.Tensor",))
    assert operator_named("side A: aten.sqrt, aten.reciprocal | side B: aten.rsqrt", ("aten.sqrt.default",))
    assert not operator_named("aten.mm.default", ("aten.add.Tensor",))
    assert not operator_named(None, ("aten.add.Tensor",))


def test_benchmark_table_counts_honestly():
    """The benchmark's table: rates over effective plants only, unresolved and wrong operators apart, false
    repros from the controls."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_locate_plants.py"
    spec = importlib.util.spec_from_file_location("bench_locate_plants", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    base = {"mode": "plant", "family": "llama", "kind": "eps", "plant": "p", "status": "localized", "seconds": 2.0,
            "layer_right": True, "module_right": True, "operator_right": True, "operator": "aten.add.Tensor",
            "repro_exit": 1, "repro_proves": "same operator, arguments that differ: x", "seed": 0, "kernels": "stock",
            "op_class": "norm"}
    rows = [base, dict(base, operator=None, operator_right=False, repro_exit=None, seed=1),
            dict(base, status="absorbed", seed=2),
            {"mode": "clean", "family": "llama", "status": "no divergence", "clean": True, "repro_exit": None},
            {"mode": "symmetric", "family": "llama", "status": "localized", "clean": False, "repro_exit": 1}]
    text = bench.table(rows)
    assert "| operator right | 50.0 % (1/2) | 50.0 % (1/2) |" in text
    assert "| operator unresolved | 1 | 1 |" in text
    assert "controls clean: 1/2" in text and "repros exiting 1 without a one-sided plant (controls): 1" in text
    assert "1 rounded away before any compared stage" in text
    # every kind drawn is counted, the redrawn plant too
    assert "| norm | eps | stock | 3 | 0 | 1 | 2 | 1 | 1 | 0 |" in text, text
    # a repro without its rerun counts as not shown to exit 0, and is listed
    assert "| repro exits 0 without the plant | 0.0 % (0/1) | 0.0 % (0/1) |" in text
    assert "repros that do not exit 0 without the plant:" in text
    rows[0] = dict(base, repro_exit_without_plant=0, repro_without_plant_kind="operator")
    text = bench.table(rows)
    assert "| repro exits 0 without the plant | 100.0 % (1/1) | 100.0 % (1/1) |" in text
    assert "| without the plant: operator / module rerun | 1 / 0 | 1 / 0 |" in text
    assert "repros that do not exit 0 without the plant:" not in text
    rows[0] = dict(base, repro_exit_without_plant=1, repro_without_plant_kind="operator")
    text = bench.table(rows)
    assert "| repro exits 0 without the plant | 0.0 % (0/1) | 0.0 % (0/1) |" in text
    assert "| repro exits 1 without the plant | 1 | 1 |" in text
