"""The GPU shape sweep's pieces that need no GPU: the shape registry builds each public model's cut with
transformers, the generated tic.yaml files are valid configs that C0's mode checks accept, and the table reads
gate records (benchmarks/gpu/shape_sweep.py; its GPU figures are docs/results/shape-sweep.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "gpu"))
import shape_sweep  # noqa: E402
from shapes import SHAPES  # noqa: E402

from tic.harness.engines.vllm import mode_refusals  # noqa: E402
from tic.config.schema import load_config  # noqa: E402


def test_every_shape_builds_as_its_family_with_the_counted_parameters():
    from tic.harness.model.layer_structure import build_meta

    for s in SHAPES:
        model = build_meta(s.config())
        assert type(model).__name__ == s.config()["architectures"][0]
        assert sum(p.numel() for p in model.parameters()) == pytest.approx(s.params(), rel=1e-3), s.name
        assert model.config.num_hidden_layers == 4


def test_plan_writes_valid_configs_for_every_mode_and_variant(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    args = argparse.Namespace(work=str(tmp_path), shapes="Qwen3-8B,OLMoE-1B-7B", modes="eager,graph,compiled",
                              variants="patched,stock", requests=64, max_prompt=4096, tokens=512)
    runs, loads = shape_sweep.plan(args)
    assert len(runs) == 12
    assert loads["OLMoE-1B-7B"]["max_len"] == 4096 - 512  # its context holds prompt and response
    for r in runs:
        cfg = load_config(r.config)
        assert cfg.prompts.count == 64 and cfg.sampling.max_tokens == 512 and cfg.train.kernels == "vllm"
        assert mode_refusals(cfg.rollout.options, "vllm") == []  # every mode is one tic makes consistent
        assert r.gates.split(",")[:4] == ["C0", "C3", "C4", "C5"]
        assert ("C7" in r.gates) == (r.mode == "eager")
        assert cfg.rollout.patches == ([] if r.variant == "stock" else shape_sweep.PATCHES)
        assert cfg.rollout.options["max_model_len"] >= cfg.prompts.max_len + cfg.sampling.max_tokens


def test_norm_variants_swap_or_drop_the_norm_patch_alone(tmp_path):
    args = argparse.Namespace(work=str(tmp_path), shapes="Qwen3-8B", modes="compiled",
                              variants="patched,fixed-block,no-norm", requests=64, max_prompt=4096, tokens=512)
    runs, _ = shape_sweep.plan(args)
    got = {r.variant: load_config(r.config).rollout.patches for r in runs}
    assert got["fixed-block"] == [("rmsnorm-fixed-block" if p == "rmsnorm-rows" else p) for p in got["patched"]]
    assert got["no-norm"] == [p for p in got["patched"] if p != "rmsnorm-rows"]
    assert "rmsnorm-rows" in got["patched"]


def test_gates_option_keeps_only_the_named_gates_of_each_run(tmp_path):
    args = argparse.Namespace(work=str(tmp_path), shapes="Qwen3-8B", modes="eager,graph", variants="megatron",
                              requests=64, max_prompt=4096, tokens=512, gates="C7,C8")
    runs, _ = shape_sweep.plan(args)
    assert {r.mode: r.gates for r in runs} == {"eager": "C0,C7,C8", "graph": "C0"}
    with pytest.raises(SystemExit, match="unknown gates C9"):
        shape_sweep.only_gates("C0,C3", "C9")


def _record(gate, verdict, **metrics):
    return {"gate": gate, "verdict": verdict, "reason": "why", "key_figure": "kf", "metrics": metrics,
            "details": {}}


def test_table_shows_each_gate_and_the_located_operator(tmp_path):
    c5 = _record("C5", "fail", equal_fraction=0.936, max=0.0123)
    c5["details"]["locate"] = {"first_divergent_layer": "model.layers.0", "culprit_module": "input_layernorm",
                               "first_operator": "_C.rms_norm.default", "repro_check": {"reproduces": True}}
    (tmp_path / "a.json").write_text(json.dumps({"results": [
        _record("C0", "pass"), _record("C3", "pass", equal_fraction=1.0, max=0.0), c5]}))
    (tmp_path / "b.json").write_text(json.dumps({"results": [
        {**_record("C0", "fail"), "reason": "not covered: q_norm"}]}))
    (tmp_path / "sweep.json").write_text(json.dumps({"runs": [
        {"name": "a", "shape": "S", "mode": "graph", "variant": "patched", "exit": 0},
        {"name": "b", "shape": "T", "mode": "eager", "variant": "patched", "exit": 0},
        {"name": "c", "shape": "U", "mode": "eager", "variant": "stock", "exit": 137}]}))
    rows = shape_sweep.render(tmp_path).splitlines()
    assert rows[2].startswith("| S | graph | patched | pass | pass 100.0 %, max \\|Δp\\| 0 | not run | **fail 93.6 %, max")
    assert "(eager row)" in rows[2] and "input_layernorm, _C.rms_norm.default (repro exits 1)" in rows[2]
    assert "**refused**: not covered: q_norm" in rows[3]
    assert "exit 137 before any gate" in rows[4]
    assert (tmp_path / "table.md").read_text().splitlines() == rows


def test_full_depth_parameter_counts_are_the_published_models():
    """Each entry at its full depth has the published model's parameter count (billions, as the model cards give
    them): a mistyped width or count would show here."""
    published = {"Qwen3-1.7B": 1.7, "Qwen3-4B": 4.0, "Qwen3-8B": 8.2, "Qwen3-14B": 14.8, "Qwen3-32B": 32.8,
                 "Qwen2.5-7B": 7.6, "Llama-3.1-8B": 8.0, "Mistral-7B-v0.3": 7.25, "Mistral-Nemo-12B": 12.2,
                 "Qwen3-30B-A3B": 30.5, "Mixtral-8x7B": 46.7, "OLMoE-1B-7B": 6.9}
    assert set(published) == {s.name for s in SHAPES}
    for s in SHAPES:
        assert s.params(s.layers) / 1e9 == pytest.approx(published[s.name], rel=0.02), s.name


def test_throughput_sides_are_the_modes_c0_accepts_and_vllms_defaults():
    """The throughput benchmark's consistent sides run modes in which tic makes the rollout consistent; its
    default side sets nothing (vLLM as users run it, C1's baseline)."""
    import rollout_throughput as rt

    assert rt.SIDES["default"][0] == {}
    for name in ("consistent", "consistent_graph"):
        options, env = rt.SIDES[name]
        assert mode_refusals({"enforce_eager": False, **options}, "vllm") == []
        assert env["TIC_PATCHES"].split(",") == shape_sweep.PATCHES
    assert rt.SIDES["batch_invariant"][1]["VLLM_BATCH_INVARIANT"] == "1"


def test_throughput_workloads_parse_and_rounds_rotate_the_order():
    import rollout_throughput as rt

    assert rt.parse_workload("512:256", 256)["requests"] == 256
    assert rt.parse_workload("256:2048:64", 256) | {} == {"input": 256, "output": 2048, "requests": 64, "seed": 0,
                                                           "label": "256:2048 x 64"}
    for bad in ("512", "512:0", "1:2:3:4", "a:b"):
        with pytest.raises((SystemExit, ValueError)):
            rt.parse_workload(bad, 256)
    names = ["default", "consistent", "batch_invariant"]
    firsts = {rt.order(names, r)[0] for r in range(3)}
    assert firsts == set(names) and all(sorted(rt.order(names, r)) == sorted(names) for r in range(5))


def test_throughput_rounds_keep_each_sides_patch_choices_beside_its_passes(capsys):
    """Each timed pass reports the side's run-time patch choices (cuBLAS or tic's kernel per GEMM problem, FA3's
    launch); the benchmark keeps the last per side and workload, so a ratio comes with what the side ran. Every
    pass prints a line as it ends (a run stopped early keeps what its finished passes measured)."""
    import rollout_throughput as rt

    class FakeSide:
        def __init__(self, name, cublas):
            self.name, self.cublas, self.passes = name, cublas, 0

        def run(self, work):
            if work.get("warmup"):
                return {"ready": True}
            self.passes += 1
            choices = {"gemm-fixed-order": {"cublas_problems": self.cublas + self.passes}} if self.cublas else {}
            return {"tok_s": 100.0 * self.passes, "patch_choices": choices}

    works = [rt.parse_workload("8:4:2", 2)]
    got, notes = rt.timed_rounds({"default": FakeSide("default", 0), "consistent": FakeSide("consistent", 5)},
                                 works, rounds=2)
    assert got["8:4 x 2"] == {"default": [100.0, 200.0], "consistent": [100.0, 200.0]}
    assert notes["8:4 x 2"] == {"default": {"patch_choices": {}},
                                "consistent": {"patch_choices": {"gemm-fixed-order": {"cublas_problems": 7}}}}
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[pass]")]
    assert lines[:2] == ["[pass] default 8:4 x 2 warm-up", "[pass] consistent 8:4 x 2 warm-up"]
    assert len(lines) == 6 and lines[-1].endswith("round 2: 200 tok/s"), lines


def test_throughput_profile_pass_is_untimed_shorter_and_compared_kernel_by_kernel():
    """--profile-tokens: after the timed rounds each side runs one pass under the profiler with the output capped;
    its kernel table is kept beside the ratio and printed against the default's, largest kernels first, then each
    side's GEMM problems by shape."""
    import rollout_throughput as rt

    asked = []

    class FakeSide:
        def __init__(self, ms):
            self.ms = ms

        def run(self, work):
            asked.append(work)
            if work.get("profile"):
                return {"tok_s": 1.0, "kernels": {"total_ms": sum(self.ms.values()), "kernels": [
                    {"name": k, "calls": 1, "ms": v} for k, v in self.ms.items()], "gemm_problems": [
                    {"op": "aten::mm", "shapes": "[[64, 32], [32, 16]]", "calls": 3, "ms": self.ms.get("gemm", 0)}]}}
            return {"tok_s": 1.0}

    works = [rt.parse_workload("8:512:2", 2)]
    fa3 = "flash::FlashAttnFwdSm90<" + "cute::C<128>, " * 20
    got, notes = rt.timed_rounds({"default": FakeSide({"gemm": 5.0, "attn": 2.0, fa3 + "true>": 1.0}),
                                  "consistent": FakeSide({"tic_gemm": 6.0, "attn": 3.0, fa3 + "false>": 1.5})},
                                 works, 1, 64)
    profiled = [w for w in asked if w.get("profile")]
    assert len(profiled) == 2 and all(w["output"] == 64 for w in profiled)
    assert got["8:512 x 2"] == {"default": [1.0], "consistent": [1.0]}  # the profiled pass is not a timed one
    row = {"shape": "S", "workload": "8:512 x 2", "side": "consistent",
           "kernels": {n: notes["8:512 x 2"][n]["kernels"] for n in ("default", "consistent")}}
    table = rt.kernel_comparison(row)
    lines = [ln for ln in table.splitlines() if ln.startswith("| ") and "kernel" not in ln and "op" not in ln]
    assert lines[:3] == ["| tic_gemm | - | 6.0 |", "| gemm | 5.0 | - |", "| attn | 2.0 | 3.0 |"]
    # two instantiations of one template: apart in the table, by their names' ends
    assert lines[3:5] == [f"| {rt.short(fa3 + 'false>')} | - | 1.5 |", f"| {rt.short(fa3 + 'true>')} | 1.0 | - |"]
    assert lines[3].endswith("C<128>, false> | - | 1.5 |") and len(lines[3]) < 130
    assert lines[5:] == [
        "| aten::mm | [[64, 32], [32, 16]] | 3 | 5.0 |", "| aten::mm | [[64, 32], [32, 16]] | 3 | 0.0 |"]


def test_a_hybrid_shape_is_nemotron_h_at_full_depth_and_its_consistent_side_is_what_c0_accepts():
    """Nemotron-H-8B's published layout (52 layers: 24 Mamba-2, 4 attention, 24 MLP; 8.1 B parameters); its
    throughput sides: the default one as users run vLLM, the consistent one with the Mamba patches in the decode
    graphs mode C0 accepts for the replay, its replay buffers inside the KV cache vLLM sizes."""
    import rollout_throughput as rt
    import torch
    from shapes import HybridShape, by_name
    from transformers import AutoConfig, AutoModelForCausalLM

    from tic.harness.engines.vllm import decode_graphs_only, recurrent_refusals

    (s,) = by_name(["Nemotron-H-8B"])
    assert isinstance(s, HybridShape) and s not in by_name()  # named only: the 4-layer sweep does not take it
    cfg = s.config()
    assert (cfg["num_hidden_layers"], s.mixers, s.pattern.count("*")) == (52, 24, 4)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - s.params(52)) / n < 1e-3 and 8.0e9 < n < 8.2e9

    options, env = rt.side_spec("consistent", hybrid=True)
    assert env["TIC_PATCHES"].split(",") == list(rt.MAMBA_PATCHES)
    assert decode_graphs_only(options) and recurrent_refusals(cfg, options, env["TIC_PATCHES"].split(",")) == []
    assert "cudagraph_mode" not in options  # LLM(...) takes it inside compilation_config only
    assert rt.side_spec("default", hybrid=True) == rt.SIDES["default"]
    assert rt.side_spec("only:mamba-decode-replay", hybrid=True)[0] == rt.HYBRID_CONSISTENT
    # the fixed-block side: the consistent side of any kind with the padded norm for the row kernel, nothing else
    for kind in ({}, {"hybrid": True}, {"fp8": True}):
        consistent, padded = rt.side_spec("consistent", **kind), rt.side_spec("fixed-block", **kind)
        assert padded[0] == consistent[0] and "rmsnorm-rows" in consistent[1]["TIC_PATCHES"]
        assert padded[1]["TIC_PATCHES"] == consistent[1]["TIC_PATCHES"].replace("rmsnorm-rows", "rmsnorm-fixed-block")
    assert rt.side_gib(s, 52, 10 * rt.GiB) == rt.side_gib(s, 52, 0) + 10  # the buffers are in the cache's bytes
    kv = rt.shared_kv_gib(s, 52, 2, 100)
    assert 2 * rt.side_gib(s, 52, kv * rt.GiB) <= 100 < 2 * rt.side_gib(s, 52, (kv + 1) * rt.GiB)
