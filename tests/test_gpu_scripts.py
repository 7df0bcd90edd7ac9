"""The GPU scripts' pieces that need no GPU (benchmarks/gpu/): every generated config loads through tic's own schema
and is the variant its name says, every config a script names exists, the scripts compile (Python) and parse
(bash), every tic name they import exists, and the verdict table reads gate records. Their GPU figures are in
docs/results/ (benchmarks/gpu/README.md says which script feeds which)."""

from __future__ import annotations

import ast
import importlib
import json
import os
import py_compile
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GPU = REPO / "benchmarks" / "gpu"
sys.path.insert(0, str(GPU))
import configs  # noqa: E402
import verdicts  # noqa: E402

from tic import patches  # noqa: E402
from tic.config.schema import load_config  # noqa: E402
from tic.harness.engines.vllm import mode_refusals  # noqa: E402


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    out = tmp_path_factory.mktemp("configs")
    paths = configs.write(out, list(configs.VARIANTS))
    return {p.stem: load_config(p) for p in paths}


def test_every_config_loads_and_keeps_its_records_under_its_name(loaded):
    assert len(loaded) == len(configs.VARIANTS) > 50
    bundled = set(patches.registry())
    for name, cfg in loaded.items():
        assert (cfg.resolve(cfg.model.path) / "config.json").is_file(), name
        assert cfg.rollout.engine == "vllm" and cfg.train.device == "cuda", name
        assert set(cfg.rollout.patches) <= bundled, name
        # check.py and the scripts find a run's files by its name
        assert cfg.rollout.options["record"] == f"records/{name}-vllm.jsonl", name
        assert cfg.state_dir == Path("state") / name, name
        requests = configs.WORKLOADS[configs.VARIANTS[name].workload].get("requests", 48)
        assert cfg.prompts.count == cfg.rollout.batch_size == cfg.layouts.batch_sizes[-1] == requests, name
        assert cfg.prompts.max_len + cfg.sampling.max_tokens <= cfg.rollout.options["max_model_len"], name


def test_each_family_is_what_the_results_say_it_is(loaded):
    three = list(configs.PATCHES)
    for name, cfg in loaded.items():
        o, v = cfg.rollout.options, configs.VARIANTS[name]
        assert o["batch_invariant"] == bool(re.search(r"-bi(-|$)", name)), name
        if name.startswith("p-"):
            _, model, mode, state = name.split("-")
            assert cfg.model.path.name == model and cfg.rollout.patches == (three if state == "on" else [])
            assert o["enforce_eager"] == (mode != "graph") and o.get("enable_chunked_prefill", False) == (mode == "chunk")
        if name.startswith(("t-", "l-", "x-")):
            assert cfg.train.kernels == ("stock" if name == "t-dense-bi-stock" else "vllm"), name
        if name.startswith("l-"):
            assert cfg.perf.floor == 0.7 and cfg.training.updates == 2 and len(cfg.scale_up) == 2
            assert (o.get("cudagraph_mode") == "FULL_DECODE_ONLY") == name.endswith("-graph")
        if name.startswith("x-"):
            par = cfg.rollout.parallel
            assert (par.tp, par.dp, par.ep) == ((2 if "tp2" in name else 1), (2 if "dp2" in name else 1),
                                                (2 if "ep2" in name else 1)), name
            assert (configs.SLOT_ORDER in cfg.rollout.patches) == (
                name in ("x-moe4-ep1-slot", "x-moe4-dp2", "x-moe4-dp2ep2", "x-moe4-dp2ep2-tdp2")), name
        assert cfg.locate.enabled == v.locate
        # the rollout mode is one C0 accepts unless the config measures vLLM's batch-invariant mode
        assert (mode_refusals(o, cfg.train.kernels) == []) == (not v.batch_invariant), name


def test_model_folders_are_the_ones_the_configs_use():
    used = {v.model for v in configs.VARIANTS.values()}
    assert used == {p.name for p in configs.MODELS_DIR.iterdir() if p.is_dir()}


def test_configs_cli_writes_lists_and_refuses_an_unknown_name(tmp_path):
    run = lambda *a: subprocess.run([sys.executable, str(GPU / "configs.py"), *a], capture_output=True, text=True)
    r = run(str(tmp_path), "p-dense-*-on", "t-dense-eager")
    assert r.returncode == 0, r.stderr
    assert sorted(p.stem for p in tmp_path.glob("*.yaml")) == sorted(
        ["p-dense-eager-on", "p-dense-graph-on", "p-dense-chunk-on", "t-dense-eager"])
    assert load_config(tmp_path / "t-dense-eager.yaml").train.kernels == "vllm"
    listed = run("--list").stdout.splitlines()
    assert len(listed) == len(configs.VARIANTS)
    r = run(str(tmp_path), "p-dense-eager-maybe")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "p-dense-eager-maybe" in r.stderr


def _shell_words() -> set[str]:
    """Config names the shell scripts pass on: words that look like a variant name (a family prefix, or a
    first-run model name), outside comments."""
    words = set()
    for sh in GPU.glob("*.sh"):
        for line in sh.read_text().splitlines():
            code = line.split("#", 1)[0] if not line.lstrip().startswith("python3 -c") else line
            words |= set(re.findall(r"(?:(?<=:-)|(?<![\w$/.-]))(?:[ptlxa]-[a-z0-9]+(?:-[a-z0-9]+)*|(?:dense|moe|big)-"
                                    r"(?:default|bi|chunk64|graph))(?![\w$/-])", code))
    return words


def test_every_config_a_script_names_is_generated():
    named = _shell_words()
    assert {"l-dense-eager", "t-dense-bi-locate", "x-moe4-dp2ep2-tdp2", "dense-chunk64"} <= named
    assert named - set(configs.VARIANTS) == set()


def test_scripts_compile_and_parse(tmp_path):
    for py in sorted(GPU.glob("*.py")):
        py_compile.compile(str(py), cfile=str(tmp_path / (py.name + "c")), doraise=True)
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    for sh in sorted(GPU.glob("*.sh")):
        r = subprocess.run([bash, "-n", str(sh)], capture_output=True, text=True)
        assert r.returncode == 0, f"{sh.name}: {r.stderr}"


def _tic_imports(path: Path) -> list[tuple[str, str | None, int]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tic":
            out += [(node.module, a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == "tic"]
    return out


def test_every_tic_name_a_benchmark_imports_exists():
    """Also the imports inside functions (a GPU script's body runs only on the device): a module or name
    moved in tic shows here, not on the GPU."""
    checked = 0
    for path in sorted((REPO / "benchmarks").rglob("*.py")):
        for module, name, line in _tic_imports(path):
            try:
                mod = importlib.import_module(module)
            except ModuleNotFoundError as e:
                if e.name and e.name.split(".")[0] == "vllm":
                    continue  # imports vLLM itself: checked where vLLM is installed
                raise AssertionError(f"{path.relative_to(REPO)}:{line}: no module {module}") from e
            if name is not None and not hasattr(mod, name):
                try:
                    importlib.import_module(f"{module}.{name}")
                except ModuleNotFoundError:
                    pytest.fail(f"{path.relative_to(REPO)}:{line}: {module} has no {name}")
            checked += 1
    assert checked > 50


def test_verdict_table_reads_ladder_records_and_per_gate_records(tmp_path):
    def rec(gate, verdict, **kw):
        return {"gate": gate, "verdict": verdict, "key_figure": f"{gate} figure", "reason": "why", **kw}

    (tmp_path / "a-ladder.json").write_text(json.dumps({"results": [rec("C5", "pass"), rec("C6", "fail")]}))
    (tmp_path / "b-c5.json").write_text(json.dumps({"results": [rec("C5", "fail")]}))  # tic gate C5 --json
    (tmp_path / "b-c0.json").write_text(json.dumps({"verdict": "fail", "key": "refused", "reason": "TP>1"}))  # tp_c5
    lines = verdicts.table(tmp_path, ["a", "b", "c"], ["C0", "C5", "C6"], "figure").splitlines()
    assert lines[0] == "| config | C0 | C5 | C6 |"
    assert lines[2] == "| a | not run (see log) | pass C5 figure | fail C6 figure |"
    assert lines[3] == "| b | fail refused | fail C5 figure | not run (see log) |"
    assert lines[4].count("not run (see log)") == 3
    assert verdicts.table(tmp_path, ["a"], ["C5"], "verdict").splitlines()[2] == "| a | pass |"
    assert "pass: C5 figure -- why" in verdicts.table(tmp_path, ["a"], ["C5"], "reason")


def test_every_attribute_a_benchmark_reads_of_a_tic_module_exists():
    """`from tic.x import mod as m` then `m.name`: the attribute must exist too (a function renamed in tic would
    otherwise surface only on the device, as the GEMM probe's did)."""
    import types

    checked = 0
    for path in sorted((REPO / "benchmarks").rglob("*.py")):
        tree = ast.parse(path.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tic":
                for a in node.names:
                    try:
                        obj = importlib.import_module(f"{node.module}.{a.name}")
                    except ModuleNotFoundError:
                        continue
                    if isinstance(obj, types.ModuleType):
                        aliases[a.asname or a.name] = obj
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                mod = aliases[node.value.id]
                assert hasattr(mod, node.attr), f"{path.relative_to(REPO)}:{node.lineno}: {mod.__name__} has no " \
                                                f"{node.attr}"
                checked += 1
    assert checked > 5


# ---- megatron_step_bench.py: tic's Megatron step vs plain Megatron-core ---------------------------------------------
def test_megatron_step_bench_arguments_order_and_table():
    import megatron_step_bench as bench
    import torch

    args = bench.parse_args([])
    assert (args.shape, args.layers, args.kernels, args.device) == ("Qwen3-8B", 4, "vllm", "cuda")
    for bad in (["--repeats", "0"], ["--shape", "Gemma-3-12B"], ["--kernels", "stock"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
    order = []
    times = bench.alternate({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, 1, 3, lambda: None)
    assert order == ["a", "b", "a", "b", "b", "a", "a", "b"] and [len(t) for t in times.values()] == [3, 3]
    s = bench.summary({"t": [2.0, 4.0, 3.0], "p": [1.0, 2.0, 3.0]}, "t", "p")
    assert s["ratio"] == (2.0, 1.0, 2.0) and s["sides"]["t"] == (3.0, 2.0, 4.0)
    lines = bench.table(s).splitlines()
    assert lines[2].split("|")[2:4] == ["    3000.00 ", "  2000.00..4000.00 "]
    assert lines[-1] == "ratio tic/plain: 2.000x (per-pair min..max 1.000..2.000, 3 pairs)"
    mask = torch.ones(1, 3)
    ref = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]])
    assert bench.same_model({"tic": ref + 1e-7, "plain": ref}, mask, torch.float32)[0]
    assert not bench.same_model({"tic": ref.flip(-1), "plain": ref}, mask, torch.float32)[0]


def test_megatron_step_bench_runs_on_a_tiny_model_on_the_cpu(monkeypatch, capsys):
    """The whole script on CPU (consistent kernels): both models build, load the same weights and compute one model
    (the logits check), and both steps run. Megatron's rotary embedding and its attention's RNG fork want a GPU:
    they are given the CPU here."""
    pytest.importorskip("megatron.core")
    import contextlib

    import megatron_step_bench as bench
    import torch
    from megatron.core.tensor_parallel import random as mp_random

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(mp_random.get_cuda_rng_tracker(), "fork", lambda *a, **k: contextlib.nullcontext())
    code = bench.main(["--tiny", "--device", "cpu", "--kernels", "consistent", "--batch", "2", "--seq", "12",
                       "--repeats", "2", "--warmup", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "ok   same model" in out and "ratio tic/plain:" in out and "plain Megatron-core (local spec)" in out


def test_locate_trace_plants_the_eps_by_its_hf_name_on_the_megatron_engine(example, workdir):
    """locate_trace.py --plant-eps finds the norm through the train engine's capture runner: on the Megatron
    engine, model.layers.N.post_attention_layernorm is decoder.layers.N.pre_mlp_layernorm."""
    pytest.importorskip("megatron.core")
    import locate_trace

    from tic.config.schema import EngineConfig
    from tic.skill.context import GateContext

    cfg = load_config(example("tiny-qwen3") / "tic-consistent.yaml")
    cfg.train = EngineConfig.model_validate({**cfg.train.model_dump(), "engine": "megatron"})
    ctx = GateContext(cfg)
    locate_trace.plant_eps(ctx, 2)
    layers = ctx.train_engine().model.gpt.decoder.layers
    assert [layer.pre_mlp_layernorm.eps for layer in layers] == [1e-6, 1e-6, 1e-3, 1e-6]


def test_the_queue_runs_phases_in_order_and_collect_reports_each_job(tmp_path):
    """run_queue.sh: a phase's jobs side by side, the next phase after it, each job's exit status and output kept;
    collect waits on the queue's files and packs them. A failing job is reported, and does not stop the queue."""
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    env = {**os.environ, "TIC_GPU_WORK": str(tmp_path / "w"), "OUT": str(tmp_path / "out")}
    script = str(GPU / "run_queue.sh")
    first = "sleep 1; echo one > $OUT/one.txt ;; echo 'two words'; exit 3"  # phase two needs one.txt
    second = "test -f $TIC_GPU_WORK/../p1-job1/out/one.txt && echo after-phase-one"
    r = subprocess.run([bash, script, "start", first, second], capture_output=True, text=True, env=env, cwd=REPO)
    assert r.returncode == 0 and "2 phase(s), 3 job(s)" in r.stdout, r.stderr
    r = subprocess.run([bash, script, "collect", "60"], capture_output=True, text=True, env=env, cwd=REPO)
    assert r.returncode == 0 and "queue finished" in r.stdout, r.stdout + r.stderr
    assert "== p1-job2 (exit 3): echo 'two words'; exit 3\ntwo words" in r.stdout
    assert "== p2-job1 (exit 0)" in r.stdout and "after-phase-one" in r.stdout
    with tarfile.open(tmp_path / "out" / "queue.tgz") as t:
        assert {"./p1-job1/out/one.txt", "./p2-job1.log", "./done"} <= set(t.getnames())
    r = subprocess.run([bash, script, "start"], capture_output=True, text=True, env=env, cwd=REPO)
    assert r.returncode == 2 and r.stderr.strip() == "start needs at least one phase"


def test_skip_stops_a_running_job_and_what_it_started_and_the_next_phase_runs(tmp_path):
    """run_queue.sh skip: a job that runs too long is stopped with the processes it started (its process group),
    never the caller; its phase ends, the next phase runs, and collect reports the job as skipped."""
    bash = shutil.which("bash")
    if bash is None or shutil.which("setsid") is None:
        pytest.skip("no bash or setsid")
    env = {**os.environ, "TIC_GPU_WORK": str(tmp_path / "w"), "OUT": str(tmp_path / "out")}
    script = str(GPU / "run_queue.sh")
    slow = "bash -c 'sleep 120; echo inner-done' & sleep 120; echo slow-done"
    r = subprocess.run([bash, script, "start", f"{slow} ;; echo quick", "echo next-phase"], capture_output=True,
                       text=True, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr
    queue = tmp_path / "w" / "queue"
    for _ in range(100):  # both jobs of phase one started, the quick one ended
        if (queue / "p1-job1.pid").exists() and (queue / "p1-job2.rc").exists():
            break
        time.sleep(0.1)
    group = int((queue / "p1-job1.pid").read_text())
    r = subprocess.run([bash, script, "skip", "p1-job9"], capture_output=True, text=True, env=env, cwd=REPO)
    assert r.returncode == 2 and r.stderr.strip() == "no job p1-job9 in the queue"
    r = subprocess.run([bash, script, "skip"], capture_output=True, text=True, env=env, cwd=REPO)
    assert r.returncode == 0 and r.stdout.strip() == "skipped 1 running job(s)", r.stdout + r.stderr
    r = subprocess.run([bash, script, "collect", "30"], capture_output=True, text=True, env=env, cwd=REPO)
    assert "queue finished" in r.stdout, r.stdout
    assert "== p1-job1 (skipped, exit 143)" in r.stdout and "== p1-job2 (exit 0)" in r.stdout
    assert "== p2-job1 (exit 0)" in r.stdout and "next-phase" in r.stdout
    assert "done" not in (queue / "p1-job1.log").read_text()  # neither the job nor what it started ended
    for _ in range(100):  # the inner sleep goes with its job (a loaded machine may take a moment to reap it)
        alive = subprocess.run(["pgrep", "-a", "-g", str(group)], capture_output=True, text=True)
        if not alive.stdout.strip():
            break
        time.sleep(0.1)
    assert alive.stdout.strip() == "", alive.stdout


def test_patch_benchmark_runs_vllm_defaults_against_the_consistent_rollout_c0_accepts():
    """bench_vllm_patches.py: the default and batch-invariant variants are vLLM as users run it (no options); the
    patched one is the consistent rollout of the GPU configs (their patch list, every one a bundled patch, in the
    compiled mode C0 accepts for a training side on vLLM's kernels)."""
    spec = importlib.util.spec_from_file_location("bench_vllm_patches", REPO / "benchmarks" / "bench_vllm_patches.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    variants = {label: (env, options) for label, env, options in bench.VARIANTS}
    assert variants["default"] == ({"VLLM_BATCH_INVARIANT": "0", "TIC_PATCHES": ""}, {})
    assert variants["batch_invariant"][1] == {}
    env, options = variants["tic_patches"]
    assert env["TIC_PATCHES"].split(",") == list(configs.PATCHES)
    assert set(configs.PATCHES) <= set(patches.registry())
    from tic.harness.engines.vllm import compiles_with_inductor

    assert compiles_with_inductor(options) and mode_refusals(options, "vllm") == []  # compiled, and accepted
    assert mode_refusals({"enforce_eager": False}, "vllm")  # vLLM's default compilation alone is refused


def test_split_bundle_fits_each_chunk_beside_the_tree_and_keeps_the_bytes(tmp_path):
    """split_bundle.sh: as few chunks as fit a device call beside this working tree, sizes even, the bundle's
    bytes unchanged in order; a folder without chunks is one line and exit 2."""
    bash = shutil.which("bash")
    if bash is None or shutil.which("git") is None:
        pytest.skip("no bash or git")
    data = os.urandom(20 << 20)
    for i, part in enumerate((data[:7 << 20], data[7 << 20:])):  # vllm-bundle's layout: c<i>/part.<i>
        (tmp_path / f"c{i}").mkdir()
        (tmp_path / f"c{i}" / f"part.{i}").write_bytes(part)
    def split(reserve_mib: int):
        run = subprocess.run([bash, str(GPU / "split_bundle.sh"), str(tmp_path), str(reserve_mib)],
                             capture_output=True, text=True, cwd=GPU.parent.parent)
        assert run.returncode == 0, run.stderr
        chunks = sorted(tmp_path.glob("c*/part.*"), key=lambda p: int(p.suffix[1:]))
        assert b"".join(p.read_bytes() for p in chunks) == data and run.stdout.count("run carry=") == len(chunks)
        return int(re.search(r"tree (\d+) MiB", run.stderr).group(1)), [p.stat().st_size for p in chunks]

    tree_mib, sizes = split(0)
    assert len(sizes) == 1  # 20 MiB fit one call beside the tree
    tree_mib, sizes = split(64 - tree_mib - 1 - 8)  # room for 8 MiB a call: three even chunks
    assert len(sizes) == 3 and max(sizes) <= 8 << 20 and max(sizes) - min(sizes) <= 2
    empty = tmp_path / "empty"
    empty.mkdir()
    bad = subprocess.run([bash, str(GPU / "split_bundle.sh"), str(empty)], capture_output=True, text=True,
                         cwd=GPU.parent.parent)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
