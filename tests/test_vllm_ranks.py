"""tic's vLLM rank processes on CPU, with a stand-in engine per rank: requests dealt round-robin and gathered
back in order, replicas pinned to one GPU each, SPMD ranks (vLLM DP x EP) kept in lockstep with placeholder
calls, a rank's bad input kept as bad input."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tic.core.errors import TicInputError
from tic.harness.engines.base import Sampling

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
from tic_vllm_standin import StandInVLLM  # noqa: E402

from tic.harness.engines.vllm_ranks import RankedVLLMEngine  # noqa: E402

STANDIN = "tic_vllm_standin:StandInVLLM"
KW = dict(model_dir=Path("."), dtype="bfloat16", options={}, batch_size=2, max_positions=64, vocab_size=50,
          patch_names=["moe-slot-order-sum"])
PROMPTS = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10], [11]]  # uneven: rank 0 holds 3 (two calls), rank 1 holds 2


def one_process(prompts, sampling, ids):
    return StandInVLLM(**KW).generate_together(prompts, sampling, ids)


@pytest.mark.parametrize("ep", [1, 2])
def test_ranks_deal_and_gather_like_one_engine(ep):
    eng = RankedVLLMEngine(KW, dp=2, ep=ep, timeout_s=60, engine_path=STANDIN)
    try:
        sampling = Sampling(temperature=1.0, max_tokens=4, seed=3)
        ids = [10, 11, 12, 13, 14]
        got = eng.generate(PROMPTS, sampling, ids)
        want = one_process(PROMPTS, sampling, ids)
        assert [s.prompt_ids for s in got] == PROMPTS
        for g, w in zip(got, want):
            assert g.response_ids == w.response_ids and torch.equal(g.logprobs, w.logprobs)
        assert [s.meta["rank"] for s in got] == [0, 1, 0, 1, 0]
        assert eng.generate_together(PROMPTS[:1], sampling, ids[:1])[0].meta["rank"] == 0  # rank 1: a turn only
        scored = eng.score(got, sampling)
        assert [len(t) for t in scored] == [4] * 5 and scored[3][0] == -0.5 - 0.001 * sum(PROMPTS[3])
        env = eng.fingerprint()["env"]
        if ep == 1:  # replicas: one GPU each, no vLLM DP group
            assert env["VLLM_DP_SIZE"] is None and env["CUDA_VISIBLE_DEVICES"] == "0"
        else:
            assert env["VLLM_DP_SIZE"] == "2" and env["VLLM_DP_RANK"] == "0"
        assert eng.fingerprint()["parallel"] == ("DP2 EP2" if ep == 2 else "DP2 (replicas)")
        # what a training side on vLLM's kernels is built to match: the ranks' engine as it resolved itself
        assert eng.rollout_kernels == StandInVLLM.rollout_kernels and eng.kv_block_size == 16
    finally:
        eng.close()


def test_spmd_ranks_without_placeholders_would_hang():
    """The stand-in's lockstep is real: a rank that skips a turn leaves the other waiting (pool timeout)."""
    from tic.harness.engines import vllm_ranks

    eng = RankedVLLMEngine(KW, dp=2, ep=2, timeout_s=15, engine_path=STANDIN)
    try:
        calls = [[([[1]], [0]), ([[2]], [1])], [([[3]], [2])]]
        with pytest.raises(RuntimeError):
            eng.pool.call(vllm_ranks._generate_rank, [(c, 0, Sampling(max_tokens=2)) for c in calls])
    finally:
        eng.close()


@pytest.mark.parametrize("kw, why", [
    (dict(dp=2, ep=2, tp=2), "TP = 1"),
    (dict(dp=4, ep=2), "ep = 4 here"),
])
def test_uncovered_rank_layouts_are_input_errors(kw, why):
    with pytest.raises(TicInputError, match=why):
        RankedVLLMEngine(KW, engine_path=STANDIN, **kw)


def test_bad_input_inside_a_rank_is_an_input_error():
    with pytest.raises(TicInputError, match=r"rank [01]: .*vocab"):
        RankedVLLMEngine({**KW, "vocab_size": "not a number"}, dp=2, timeout_s=60,
                         engine_path="tic_vllm_standin:RefusingVLLM")


@pytest.mark.parametrize("ep", [1, 2])
def test_the_locator_reruns_a_request_on_its_owner_rank(ep):
    """The owner rank captures on its own share; under DP x EP the other rank takes turns until released."""
    from tic.harness.locate.capture import Capture
    from tic.harness.locate.runners import runner_for

    eng = RankedVLLMEngine(KW, dp=2, ep=ep, timeout_s=30, engine_path=STANDIN)
    try:
        samples = eng.generate(PROMPTS, Sampling(max_tokens=2), [10, 11, 12, 13, 14])
        runner = runner_for(eng, 1.0)
        assert runner.stages() == ["model.layers.0"] and runner.repro_setup == ["import os"]
        cap = runner.decode(samples, 3, 1, None)  # request 3 lives on rank 1, second of its share (11, 13)
        assert isinstance(cap, Capture)
        assert cap.owner == {"prompt": PROMPTS[3], "index": 1, "share": [11, 13]}
        again = runner.score(samples, 4, None)  # rank 0; the lockstep survived the first capture
        assert again.owner["prompt"] == PROMPTS[4]
        with pytest.raises(RuntimeError, match="planted"):  # a failing capture releases the serving rank
            runner.decode(samples, 0, 0, "fail")
        # and leaves the engine working: the ladder's later gates (--keep-going) still have their rollout
        assert [s.prompt_ids for s in eng.generate(PROMPTS[:3], Sampling(max_tokens=2), [0, 1, 2])] == PROMPTS[:3]
    finally:
        eng.close()


def test_a_ranks_bad_input_is_reported_while_the_others_wait_in_lockstep():
    """Rank 1 refuses its prompt while rank 0 waits in the lockstep collective for it: the pool reports rank 1's
    input error at once, not rank 0's wait running out."""
    import time

    eng = RankedVLLMEngine(KW, dp=2, ep=2, timeout_s=60, engine_path="tic_vllm_standin:CheckingVLLM")
    try:
        t0 = time.monotonic()
        with pytest.raises(TicInputError, match="rank 1: token id outside"):
            eng.generate([[1, 2], [99]], Sampling(max_tokens=2), [0, 1])
        assert time.monotonic() - t0 < 15  # the stand-in's collective gives up after 20 s
    finally:
        eng.close()


def test_replicas_take_the_gpus_this_process_was_given(monkeypatch):
    """A scheduler that hands this process GPUs 5 and 7 (CUDA_VISIBLE_DEVICES) gets replicas on 5 and 7, not on
    physical GPUs 0 and 1, which belong to someone else."""
    from tic_vllm_standin import rank_env

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    eng = RankedVLLMEngine(KW, dp=2, ep=1, timeout_s=60, engine_path=STANDIN)
    try:
        assert [e["CUDA_VISIBLE_DEVICES"] for e in eng.pool.call(rank_env, [()] * 2)] == ["5", "7"]
    finally:
        eng.close()


def test_perf_sides_on_ranks_run_each_rank_engine_inline(monkeypatch):
    """C1/C10 ask each rollout side for an engine process of its own (engine_process: own); vLLM rank processes
    are that already, so the ranks run their engine inline instead of refusing the option C1/C10 set."""
    from tic.harness.engines.vllm import VLLMEngine
    from tic.harness.model.facts import ModelFacts
    from tic.config.schema import EngineConfig

    side = EngineConfig.model_validate({"engine": "vllm", "parallel": {"dp": 2, "ep": 2}, "patches": [],
                                        "options": {}})
    side = EngineConfig.model_validate({**side.model_dump(), **VLLMEngine.perf_changes(side)})
    model = ModelFacts(Path("."), "bfloat16", {"max_position_embeddings": 64, "vocab_size": 50})
    seen = {}

    def init(self, engine_kwargs, dp, ep=1, tp=1, **kw):
        seen.update(engine_kwargs=engine_kwargs, dp=dp, ep=ep)

    monkeypatch.setattr(RankedVLLMEngine, "__init__", init)
    RankedVLLMEngine.from_config(side, model, lambda p: p)
    assert seen["engine_kwargs"]["options"]["engine_process"] == "inline" and (seen["dp"], seen["ep"]) == (2, 2)


def test_ranked_sides_differ_only_by_vllms_consistency_switch():
    """C10 compares a baseline and a consistent rollout's fingerprints; on ranks, as on one vLLM engine, the
    batch-invariant mode and the patches are the switch, not a difference that refuses the comparison."""
    from tic.harness.engines.vllm import VLLMEngine
    from tic.harness.measure.perf import switch_allowance

    assert switch_allowance(RankedVLLMEngine.__new__(RankedVLLMEngine)) == \
        switch_allowance(VLLMEngine.__new__(VLLMEngine))
