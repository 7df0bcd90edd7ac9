"""The vLLM adapter on the CPU: conversions checked on records saved from real H200 runs (vLLM 0.26.0).

tests/fixtures/vllm/h200-records.tar.xz holds what benchmarks/gpu/run.sh brought back: the raw vLLM
outputs (records/<name>-vllm.jsonl), the HF train-side logprobs (<name>-train.jsonl), the ladder JSON and the
capture localisation, for a small run (run-small) and a long-context run (run-long).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from tic.harness.engines.vllm import check_options, compiles_with_inductor, mode_refusals, sample_from_record, \
    scored_from_record
from tic.harness.measure.metrics import compare_generation, compare_logprobs
from tic.core.errors import TicInputError

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "vllm" / "h200-records.tar.xz"
CONFIGS = [("run-small", n) for n in ("dense-default", "dense-bi", "moe-default", "moe-bi", "dense-chunk16")] + \
          [("run-long", n) for n in ("dense-default", "dense-bi", "moe-default", "moe-bi", "dense-chunk64",
                                     "dense-v1runner")]


def extract(fixture: Path, d: Path) -> Path:
    """Unpack committed device records; the safe 'data' filter where this Python has it (3.11.4+, 3.12+)."""
    with tarfile.open(fixture) as tf:
        if hasattr(tarfile, "data_filter"):
            tf.extractall(d, filter="data")
        else:
            tf.extractall(d)
    return d


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> Path:
    return extract(FIXTURE, tmp_path_factory.mktemp("vllm-records"))


def load(d: Path, run: str, name: str):
    recs = [json.loads(l) for l in (d / run / "records" / f"{name}-vllm.jsonl").read_text().splitlines()]
    train = [json.loads(l) for l in (d / run / f"{name}-train.jsonl").read_text().splitlines()]
    ladder = {r["gate"]: r for r in json.loads((d / run / f"{name}-ladder.json").read_text())["results"]}
    return recs, train, ladder


def test_import_tic_does_not_import_vllm():
    code = "import sys, tic, tic.harness.engines, tic.harness.engines.vllm; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_vllm_engine_without_gpu_is_a_clear_input_error(tmp_path, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tic.yaml").write_text(
        f"model: {{path: {REPO / 'benchmarks/gpu/models/dense'}, dtype: bfloat16, generate: {{seed: 0}}}}\n"
        "rollout: {engine: vllm}\n")
    r = subprocess.run([sys.executable, "-c", "from tic.skill.cli import main; main(['ladder', '--from', "
                        "'C3', '--to', 'C3'])"], capture_output=True, text=True)
    assert r.returncode == 2
    err = [l for l in r.stderr.splitlines() if l.startswith("tic: error:")]
    assert len(err) == 1 and "vllm" in err[0].lower() and ("GPU" in err[0] or "imported" in err[0])


def test_unknown_option_is_rejected():
    with pytest.raises(TicInputError, match="unknown vllm option 'enforce_eagre'"):
        check_options({"enforce_eagre": True})
    with pytest.raises(TicInputError, match="logprobs_mode"):
        check_options({"logprobs_mode": "raw_logits"})


@pytest.mark.parametrize("options, compiled", [
    ({}, False),  # tic's default: enforce_eager
    ({"enforce_eager": False}, True),  # vLLM's default compilation mode
    ({"enforce_eager": False, "compilation_config": 3}, True),
    ({"enforce_eager": False, "compilation_config": {"mode": 0}}, False),
    ({"enforce_eager": False, "compilation_config": {"mode": "NONE"}}, False),
    ({"enforce_eager": False, "compilation_config": {"mode": 3, "backend": "eager"}}, False),
])
def test_which_options_compile_with_inductor(options, compiled):
    assert compiles_with_inductor(options) is compiled


def test_c0_refuses_compiled_kernels_the_training_forward_does_not_run(monkeypatch):
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    keep = {"rms_norm": ["vllm_c"], "fused_add_rms_norm": "vllm_c,native"}
    compiled = {"enforce_eager": False, "compilation_config": {"mode": 3, "custom_ops": ["all"]}}
    assert mode_refusals({**compiled, "ir_op_priority": keep}, "vllm") == []
    for bad in ({**compiled}, {**compiled, "ir_op_priority": {"rms_norm": ["native"]}},
                {"enforce_eager": False, "compilation_config": {"custom_ops": ["all", "-rms_norm"]}, "ir_op_priority": keep},
                {"enforce_eager": False, "ir_op_priority": keep}):
        (line,) = mode_refusals(bad, "vllm")
        assert "custom_ops: [all]" in line and "\n" not in line
    assert mode_refusals({"enforce_eager": False}, "stock") == []  # no training forward on vLLM's kernels to match
    assert mode_refusals({"enforce_eager": False, "compilation_config": {"mode": 0}}, "vllm") == []
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")  # the mode vLLM reads when the option is left unset
    assert "batch-invariant" in mode_refusals({}, "stock")[0]
    assert mode_refusals({"batch_invariant": False}, "stock") == []


@pytest.mark.parametrize("run,name", CONFIGS)
def test_conversions_reproduce_the_ladder_figures(records, run, name):
    recs, train, ladder = load(records, run, name)
    gen = [r for r in recs if r["kind"] == "generate"]
    samples = [sample_from_record(r) for r in gen]
    for s, r in zip(samples, gen):  # exactly the floats vLLM reported, as float32
        assert s.logprobs.dtype == torch.float32
        want = torch.tensor([r["logprobs"][i][str(t)] for i, t in enumerate(r["token_ids"])], dtype=torch.float64)
        assert torch.equal(s.logprobs.double(), want)
        assert s.response_ids == r["token_ids"] and s.prompt_ids == r["prompt_token_ids"]
    # C4: decode logprobs vs the prompt_logprobs of the whole sequence
    score = {}
    for r in recs:
        if r["kind"] == "score":
            score.setdefault(r["request_id"], r)
    scored = [scored_from_record(score[s.id], len(s.prompt_ids)) for s in samples]
    m4 = compare_logprobs([s.logprobs for s in samples], scored)
    assert (m4["equal_tokens"], m4["tokens"]) == (ladder["C4"]["metrics"]["equal_tokens"],
                                                  ladder["C4"]["metrics"]["tokens"])
    # (max |dp| goes through exp(), whose last bit depends on the CPU's vector math: compare the logprobs)
    assert m4["first_mismatch"] == ladder["C4"]["metrics"]["first_mismatch"]
    # C5: against the HF train side's logprobs
    tr = {(tuple(t["prompt_token_ids"]), tuple(t["token_ids"])): t["logprobs"] for t in reversed(train)}
    tl = [torch.tensor(tr[(tuple(s.prompt_ids), tuple(s.response_ids))], dtype=torch.float64).float()
          for s in samples]
    m5 = compare_logprobs([s.logprobs for s in samples], tl)
    assert (m5["equal_tokens"], m5["tokens"]) == (ladder["C5"]["metrics"]["equal_tokens"],
                                                  ladder["C5"]["metrics"]["tokens"])
    assert m5["first_mismatch"] == ladder["C5"]["metrics"]["first_mismatch"]
    # C3: the probe alone vs in each batch
    alone, eq, cmp = {}, 0, 0
    for r in recs:
        if r["kind"] != "together":
            continue
        if r["batch"] == 1:
            alone[r["request_id"]] = sample_from_record(r)
        elif r["request_id"] < len(gen):
            c = compare_generation(alone[r["request_id"]], sample_from_record(r))
            eq, cmp = eq + c["equal"], cmp + c["compared"]
    assert (eq, cmp) == (ladder["C3"]["metrics"]["equal_tokens"], ladder["C3"]["metrics"]["compared_tokens"])


def test_independent_check_script_agrees(records):
    for run in ("run-small", "run-long"):
        r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu" / "check.py"),
                            str(records / run)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.count("| yes |") == len([c for c in CONFIGS if c[0] == run])


def test_bad_records_are_input_errors(records):
    recs, _, _ = load(records, "run-long", "dense-default")
    gen = next(r for r in recs if r["kind"] == "generate")
    bad = dict(gen, logprobs=gen["logprobs"][:-1])
    with pytest.raises(TicInputError, match="logprob entries"):
        sample_from_record(bad)
    tok = str(gen["token_ids"][0])
    off = [dict(d) for d in gen["logprobs"]]
    off[0][tok] = off[0][tok] + 1e-12  # not a float32 value: would mean the logprobs were post-processed
    with pytest.raises(TicInputError, match="not a float32"):
        sample_from_record(dict(gen, logprobs=off))
    sc = next(r for r in recs if r["kind"] == "score")
    with pytest.raises(TicInputError, match="outside the scored sequence"):
        scored_from_record(sc, len(sc["prompt_token_ids"]) + 1)


# -- run 3 (this follow-up): bigger dense model, CUDA graphs, the shared locator on -----------------------
FIXTURE3 = REPO / "tests" / "fixtures" / "vllm" / "h200-records-3.tar.xz"
RUN3 = {  # config -> (C3 equal/compared, C4 equal/tokens, C5 equal/tokens or None where the run was cut short)
    ("run-3a", "big-bi"): ((576, 576), (2131, 2304), None),
    ("run-3a", "big-graph"): ((96, 576), (51, 2304), (0, 2304)),
    ("run-3a", "dense-bi"): ((576, 576), (1371, 2304), None),
    ("run-3a", "moe-bi"): ((576, 576), (1371, 2304), None),
    ("run-3b", "big-default"): ((192, 576), (53, 2304), (0, 2304)),
    ("run-3b", "dense-default"): ((576, 576), (1371, 2304), (1, 2304)),
    ("run-3b", "moe-default"): ((576, 576), (1371, 2304), (3, 2304)),
}


# run 5 (next session): the same configs with the locator's kernel-level and module-level repros
FIXTURE5 = REPO / "tests" / "fixtures" / "vllm" / "h200-records-5.tar.xz"
RUN5 = {
    ("run-5", "dense-default"): ((576, 576), (1371, 2304), (1, 2304)),
    ("run-5", "moe-default"): ((576, 576), (1371, 2304), (3, 2304)),
    ("run-5", "dense-bi"): ((576, 576), (1371, 2304), (0, 2304)),
    ("run-5", "moe-bi"): ((576, 576), (1371, 2304), (0, 2304)),
    ("run-5", "big-default"): ((192, 576), (53, 2304), (0, 2304)),
    ("run-5", "big-bi"): ((576, 576), (2131, 2304), (0, 2304)),
}
RUNS = {**RUN3, **RUN5}


@pytest.fixture(scope="module")
def records3(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("vllm-records-3")
    extract(FIXTURE3, d)
    return extract(FIXTURE5, d)


@pytest.mark.parametrize("run,name", sorted(RUNS))
def test_run3_figures_recomputed_from_raw_records(records3, run, name):
    """C3/C4/C5 recomputed here from the raw vLLM outputs and HF logprobs (torch.equal on float32 bits,
    not check.py's struct path) equal the ladder's own record and the figures in docs/results/vllm-rollout.md."""
    recs, train, ladder = load(records3, run, name)
    c3, c4, c5 = RUNS[(run, name)]
    gen = {r["request_id"]: sample_from_record(r) for r in recs if r["kind"] == "generate"}
    scored = {}
    for r in recs:
        if r["kind"] == "score" and r["request_id"] not in scored:
            s = gen[r["request_id"]]
            scored[r["request_id"]] = scored_from_record(r, len(s.prompt_ids))
    eq4 = sum(int((gen[k].logprobs.view(torch.int32) == scored[k].view(torch.int32)).sum()) for k in gen)
    assert (eq4, sum(len(s.response_ids) for s in gen.values())) == c4
    assert (ladder["C4"]["metrics"]["equal_tokens"], ladder["C4"]["metrics"]["tokens"]) == c4
    assert (ladder["C3"]["metrics"]["equal_tokens"], ladder["C3"]["metrics"]["compared_tokens"]) == c3
    if c5 is None:
        assert "C5" not in ladder  # the run was cut short after C4 (docs say so)
        return
    by_seq = {(tuple(t["prompt_token_ids"]), tuple(t["token_ids"])): t["logprobs"] for t in reversed(train)}
    eq5 = 0
    for s in gen.values():
        t = torch.tensor(by_seq[(tuple(s.prompt_ids), tuple(s.response_ids))], dtype=torch.float64)
        eq5 += int((s.logprobs.double() == t).sum())  # float32 -> float64 is exact, so == is bit equality
    assert (eq5, c4[1]) == c5
    assert (ladder["C5"]["metrics"]["equal_tokens"], ladder["C5"]["metrics"]["tokens"]) == c5


@pytest.mark.parametrize("run", ["run-3a", "run-3b", "run-5"])
def test_run3_check_script_agrees(records3, run):
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu" / "check.py"), str(records3 / run)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "| NO |" not in r.stdout


RUN5_LOCATED = {  # (config, gate) -> (first divergent layer, culprit module, a repro that reproduced on the GPU)
    ("dense-default", "C4"): ("model.layers.0", "model.layers.0.self_attn.attn", True),
    ("moe-default", "C4"): ("model.layers.0", "model.layers.0.self_attn.attn", True),
    ("dense-bi", "C4"): ("model.layers.0", "model.layers.0.self_attn.attn", True),
    ("moe-bi", "C4"): ("model.layers.0", "model.layers.0.self_attn.attn", True),
    ("dense-default", "C5"): ("model.layers.0", "model.layers.0.self_attn", True),
    ("moe-default", "C5"): ("model.layers.0", "model.layers.0.self_attn", True),
    ("dense-bi", "C5"): ("model.layers.0", "model.layers.0.self_attn", False),
    ("moe-bi", "C5"): ("model.layers.0", "model.layers.0.self_attn", False),
    ("big-default", "C3"): ("model.layers.0", "model.layers.0.mlp.down_proj", True),
    ("big-default", "C4"): ("model.layers.0", "model.layers.0.mlp.down_proj", True),
    ("big-default", "C5"): ("model.layers.0", "model.layers.0.self_attn.k_norm", True),
}


@pytest.mark.parametrize("name,gate", sorted(RUN5_LOCATED))
def test_run5_every_failure_is_located(records3, name, gate):
    """Run 5's locate records (as the ladder wrote them on the H200): each failing gate is localised, and each
    repro counted as reproducing exited 1 with its DIFFERS line in a fresh process there."""
    located = json.loads((records3 / "run-5" / f"{name}-locate.json").read_text())
    ladder = {r["gate"]: r for r in json.loads((records3 / "run-5" / f"{name}-ladder.json").read_text())["results"]}
    assert ladder[gate]["verdict"] == "fail" and gate in located
    f = located[gate]
    layer, module, reproduced = RUN5_LOCATED[(name, gate)]
    assert f["status"].startswith("localized") and f["first_divergent_layer"] == layer and f["culprit_module"] == module
    assert f["reproduced_gate_values"] is True
    chk = f["repro_check"]
    if reproduced:
        assert chk["reproduces"] and chk["exit_code"] == 1 and "DIFFERS" in chk["output"], chk
    else:  # vLLM's batch-invariant GEMMs are Triton kernels launched outside torch's dispatcher: no repro, said so
        assert chk is None and "no repro" in f["status"]
    if gate == "C4" and module.endswith("self_attn.attn"):
        assert f["first_operator"] == "_vllm_fa3_C.fwd.default" and chk["rows_a"] == 1  # cut to one sequence


# -- the vLLM capture runner on a synthetic model with vLLM's layout (flat token rows, hidden/residual apart) -----
def _synthetic_vllm():
    """A two-layer model laid out as vLLM runs it (flat token rows, hidden and residual apart, an add-norm with
    forward(*args) over forward_native) and an engine stub whose steps fill a V1-runner-like input batch: the
    prompts' prefill first, then one token per request per step, in a request order that flips every step."""
    from types import SimpleNamespace as NS

    import numpy as np
    from torch import nn

    from tic.harness.engines.base import Sampling

    H = 8

    class Norm(nn.Module):
        def forward(self, *args, **kwargs):
            return self.forward_native(*args, **kwargs)

        def forward_native(self, x, residual=None):
            if residual is None:
                return x * 2
            x = x + residual
            return x * 2, x

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm, self.mlp = Norm(), nn.Linear(H, H)

        def forward(self, positions, hidden_states, residual):
            if residual is None:
                residual, h = hidden_states, self.input_layernorm(hidden_states)
            else:
                h, residual = self.input_layernorm(hidden_states, residual)
            return self.mlp(h), residual

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens, self.layers, self.norm = nn.Embedding(50, H), nn.ModuleList([Layer(), Layer()]), Norm()

        def forward(self, input_ids, positions):
            h, r = self.embed_tokens(input_ids), None
            for layer in self.layers:
                h, r = layer(positions, h, r)
            out, _ = self.norm(h, r)
            return out

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Inner()

    torch.manual_seed(0)
    m = M()

    class Eng:
        opts = {"enforce_eager": True}
        batch_size = 8
        last_sampling = Sampling(1.0, 3, 0)

        def __init__(self):
            self.r = NS(input_batch=NS(), query_start_loc=NS(), requests={}, positions=torch.zeros(64, dtype=torch.long))

        def model(self):
            return m

        def model_runner(self):
            return self.r

        def _sampling_params(self, sp, rid):
            return None

        def _run(self, prompts, params, kind, rids):
            toks = [list(p) for p in prompts]
            n0 = [len(p) for p in prompts]
            self.r.requests = {str(i): NS(prompt_token_ids=list(p)) for i, p in enumerate(prompts)}
            for step in range(3):
                order = list(range(len(prompts)))[::(-1 if step % 2 else 1)]
                ids, pos, qsl = [], [], [0]
                for i in order:
                    ids += toks[i] if step == 0 else toks[i][-1:]
                    pos += list(range(len(toks[i]))) if step == 0 else [len(toks[i]) - 1]
                    qsl.append(len(ids))
                self.r.input_batch.num_reqs = len(order)
                self.r.input_batch.req_ids = [str(i) for i in order]
                self.r.query_start_loc.np = np.array(qsl)
                self.r.positions[:len(pos)] = torch.tensor(pos)
                with torch.inference_mode():
                    m.model(torch.tensor(ids), self.r.positions[:len(pos)])
                for i in range(len(prompts)):
                    toks[i].append((7 * i + step) % 50)
            return [{"token_ids": toks[i][n0[i]:], "logprobs": [{str(t): -1.0} for t in toks[i][n0[i]:]],
                     "prompt_token_ids": list(prompts[i])} for i in range(len(prompts))]

    return Eng(), m


def test_capture_runner_maps_flat_rows_and_replays_exactly():
    from tic.harness.locate.capture import CaptureSpec
    from tic.harness.engines.base import Sample
    from tic.harness.locate.vllm_capture import VLLMCaptureRunner
    from tic.harness.locate.search import compare_rows

    eng, _ = _synthetic_vllm()
    r = VLLMCaptureRunner(eng)
    assert r.stages() == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm"]
    names = set(r.stages()) | set(r.descendants("model.layers.0")) | set(r.descendants("model.layers.1"))
    alone = [Sample([3, 4, 5], [0, 1, 2], torch.zeros(3), id=0)]
    batch = alone + [Sample([9, 9], [7, 8, 9], torch.zeros(3), id=5), Sample([1, 2, 3, 4], [14, 15, 16], torch.zeros(3), id=6)]
    a = r.decode(alone, 0, 1, CaptureSpec(outputs=names, inputs=names), together=True)
    b = r.decode(batch, 0, 1, CaptureSpec(outputs=names), together=True)
    # prompt rows 0-2 (prefill) and decode rows 3, 4, whatever the request order in each step
    assert sorted(a.outputs["model.layers.1"]) == sorted(b.outputs["model.layers.1"]) == [0, 1, 2, 3, 4]
    assert compare_rows(a.outputs["model.embed_tokens"], b.outputs["model.embed_tokens"])["equal"]
    assert all(len(v) == 3 for v in a.inputs["model.layers.1"].values())  # (hidden + residual, hidden, residual)
    assert all(len(v) == 1 for v in a.inputs["model.layers.0"].values())  # layer 0: residual None
    h = a.inputs["model.layers.1"][0][1:]
    assert torch.equal(a.inputs["model.layers.1"][0][0], h[0] + h[1])
    # replaying side A's own inputs into the add-norm of layer 1 (CustomOp-style forward(*args)) is bit-exact
    spec = CaptureSpec(outputs={"model.layers.1.input_layernorm"},
                       replace={"model.layers.1.input_layernorm": a.inputs["model.layers.1.input_layernorm"]})
    c = r.decode(alone, 0, 1, spec, together=True)
    assert compare_rows(c.outputs["model.layers.1.input_layernorm"], a.outputs["model.layers.1.input_layernorm"])["equal"]
    # operator trail of one position inside a module: B = 1, T = the step's token rows
    t = r.decode(batch, 0, 1, CaptureSpec(trail_module="model.layers.0.mlp", trail_position=3), together=True)
    assert t.trail.batch == 1 and t.trail.length == 3 and t.trail.calls


def test_engine_process_option_and_perf_sides_in_processes_of_their_own():
    """C1/C10 sides get engine cores of their own (patches and batch-invariant mode are process-wide); an
    unknown value is refused."""
    from types import SimpleNamespace

    from tic.core.errors import TicInputError
    from tic.harness.engines.vllm import VLLMEngine, check_options

    assert check_options({})["engine_process"] == "inline"
    with pytest.raises(TicInputError, match="engine_process"):
        check_options({"engine_process": "subprocess"})
    side = SimpleNamespace(options={"enforce_eager": True})
    assert VLLMEngine.perf_changes(side) == {"options": {"enforce_eager": True, "engine_process": "own"}}


def test_baseline_is_vllm_as_users_run_it_and_only_the_switch_may_differ():
    """C1's baseline drops the consistency switch (patches, batch-invariant mode) and the mode settings the
    consistent rollout needs, so vLLM runs its default compilation and CUDA graphs; C10 lets exactly those differ."""
    from types import SimpleNamespace

    from tic.harness.engines.vllm import VLLMEngine
    from tic.harness.measure.fingerprint import differences
    from tic.harness.measure.perf import switch_allowance

    side = SimpleNamespace(options={"enforce_eager": False, "compilation_config": {"mode": 0},
                                    "cudagraph_mode": "FULL_DECODE_ONLY", "ir_op_priority": {"rms_norm": ["vllm_c"]},
                                    "max_num_seqs": 64, "kv_cache_memory_bytes": 1 << 30},
                           patches=["gemm-fixed-m"])
    assert VLLMEngine.baseline_changes(side) == {
        "options": {"max_num_seqs": 64, "kv_cache_memory_bytes": 1 << 30, "enforce_eager": False,
                    "batch_invariant": False}, "patches": []}

    def fp(llm, effective, patches):
        return {"engine": {"engine": "vllm", "patches": patches, "batch_invariant": False, "effective": effective,
                           "llm": llm}}

    base = fp({"enforce_eager": False, "max_num_seqs": 64}, {"compilation_mode": "3", "cudagraph_mode": "FULL_AND_PIECEWISE"}, [])
    cons = fp({"enforce_eager": False, "max_num_seqs": 64, "compilation_config": '{"mode": 0}',
               "ir_op_priority": "{}"}, {"compilation_mode": "0", "cudagraph_mode": "FULL_DECODE_ONLY"}, ["gemm-fixed-m"])
    allowed = switch_allowance(SimpleNamespace(switch_keys=VLLMEngine.switch_keys, switch_env=VLLMEngine.switch_env))
    assert differences(base, cons, allowed) == []
    other = fp({"enforce_eager": False, "max_num_seqs": 32}, base["engine"]["effective"], [])
    assert differences(base, other, allowed) == ["engine.llm.max_num_seqs: 64 vs 32"]  # anything else is refused


@pytest.mark.parametrize("example", ["tiny-gemma2", "tiny-gemma3", "tiny-mistral-sliding"])
def test_c0_refuses_a_vllm_rollout_whose_sliding_window_is_shorter_than_its_context_without_the_patch(example):
    from tic.harness.engines.vllm import window_refusals

    cfg = json.loads((REPO / "examples" / example / "config.json").read_text())
    (line,) = window_refusals(cfg, {"max_model_len": 256})
    assert "sliding-window" in line and f"window {cfg['sliding_window']} < max_model_len 256" in line
    assert window_refusals(cfg, {"max_model_len": cfg["sliding_window"]}) == []  # the window never masks
    full = {k: v for k, v in cfg.items() if k not in ("sliding_window", "layer_types")}
    assert window_refusals(full, {"max_model_len": 256}) == []  # the control: no window
    qwen2 = {**full, "model_type": "qwen2", "sliding_window": 4, "use_sliding_window": False}
    assert window_refusals(qwen2, {"max_model_len": 256}) == []  # a window the config switches off
    assert window_refusals(cfg, {"max_model_len": 256}, ["fa3-fixed-tile"]) == []  # the patch covers the window
    assert window_refusals(cfg, {"max_model_len": 256}, ["rmsnorm-fixed-block"]) == [line]


def test_c0_refuses_training_on_vllms_kernels_against_its_transformers_backend(monkeypatch):
    """Read from vLLM's registry: an architecture it implements natively passes; one it maps to (or, absent, falls
    back on) its Transformers backend, or model_impl: transformers, is refused for train.kernels: vllm only."""
    import types

    from tic.harness.engines.vllm import backend_refusals

    registry = types.ModuleType("vllm.model_executor.models.registry")
    registry._VLLM_MODELS = {"Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
                             "Starcoder2ForCausalLM": ("transformers", "TransformersForCausalLM")}
    for name in ("vllm", "vllm.model_executor", "vllm.model_executor.models"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.model_executor.models.registry", registry)
    qwen3, star = {"architectures": ["Qwen3ForCausalLM"]}, {"architectures": ["Starcoder2ForCausalLM"]}
    assert backend_refusals(qwen3, {}, "vllm") == []
    (line,) = backend_refusals(star, {}, "vllm")
    assert "Starcoder2ForCausalLM through its Transformers backend" in line
    assert backend_refusals({"architectures": ["NewArchForCausalLM"]}, {}, "vllm")  # absent: the fallback
    assert backend_refusals(qwen3, {"model_impl": "transformers"}, "vllm")
    assert backend_refusals(star, {}, "consistent") == backend_refusals(star, {}, "stock") == []


def test_c0_refuses_config_fields_vllms_model_code_overrides_or_ignores():
    """vLLM 0.26's GlmForCausalLM sets partial_rotary_factor to 0.5 and its StableLM layer never reads
    use_parallel_residual: a config that says otherwise is refused with the field and value; the configs vLLM
    reads as written, other architectures and other vLLM releases are not."""
    from tic.harness.engines.vllm import departure_refusals

    glm = {"architectures": ["GlmForCausalLM"], "rope_parameters": {"partial_rotary_factor": 0.5}}
    assert departure_refusals(glm, "0.26.0") == []
    quarter = {**glm, "rope_parameters": {"partial_rotary_factor": 0.25}}
    (line,) = departure_refusals(quarter, "0.26.0")
    assert "GlmForCausalLM" in line and "partial_rotary_factor=0.25" in line
    assert departure_refusals({"architectures": ["GlmForCausalLM"], "partial_rotary_factor": 1.0}, None)
    stablelm = {"architectures": ["StableLmForCausalLM"], "use_parallel_residual": False}
    assert departure_refusals(stablelm, "0.26.0") == []
    (line,) = departure_refusals({**stablelm, "use_parallel_residual": True}, "0.26.0")
    assert "use_parallel_residual=True" in line
    assert departure_refusals({**stablelm, "use_parallel_residual": True}, "0.27.0") == []  # not read there
    assert departure_refusals({"architectures": ["LlamaForCausalLM"], "partial_rotary_factor": 0.25}, "0.26.0") == []
