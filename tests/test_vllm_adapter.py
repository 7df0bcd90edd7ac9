"""The vLLM adapter on the CPU: conversions checked on records saved from real H200 runs (vLLM 0.26.0).

tests/fixtures/vllm/h200-records.tar.xz holds what examples/vllm-h200/run.sh brought back: the raw vLLM
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

from tic.harness.engines.vllm import check_options, sample_from_record, scored_from_record
from tic.harness.metrics import compare_generation, compare_logprobs
from tic.skill.errors import TicInputError

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "vllm" / "h200-records.tar.xz"
CONFIGS = [("run-small", n) for n in ("dense-default", "dense-bi", "moe-default", "moe-bi", "dense-chunk16")] + \
          [("run-long", n) for n in ("dense-default", "dense-bi", "moe-default", "moe-bi", "dense-chunk64",
                                     "dense-v1runner")]


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("vllm-records")
    with tarfile.open(FIXTURE) as tf:
        tf.extractall(d, filter="data")
    return d


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
        f"model: {{path: {REPO / 'examples' / 'vllm-h200' / 'dense'}, dtype: bfloat16, generate: {{seed: 0}}}}\n"
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
        r = subprocess.run([sys.executable, str(REPO / "examples" / "vllm-h200" / "check.py"),
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
