"""C1, C8, C9, C10: each passes on the consistent CPU kernels and fails on its planted fault.

A one-layer copy of the tiny Qwen3 keeps the RL steps and timing passes short."""

import json
import os
from pathlib import Path

import pytest
import torch

from tic.gates import get
from tic.gates.c1 import perf_side
from tic.harness.measure import baseline as bl
from tic.harness.engines import hf
from tic.harness.engines.hf import HFEngine
from tic.harness.measure.rl import PolicyGradientTrainer
from tic.skill.baseline_cmd import measure_baseline
from tic.config.schema import PerfConfig, load_config
from tic.skill.context import GateContext
from tic.skill.runner import run_gate

SUPPORT = Path(__file__).resolve().parent / "support"
SMALL_PERF = "perf: {requests: 2, input_len: 4, output_len: 4, concurrency: 2, repeats: 3, warmup: 0}\n"


@pytest.fixture
def small(example, workdir):
    """A one-layer tiny Qwen3 with consistent kernels; returns its tic.yaml path."""
    hf._MODELS.clear()
    ex = example("tiny-qwen3")
    c = json.loads((ex / "config.json").read_text())
    c["num_hidden_layers"] = 1
    (ex / "config.json").write_text(json.dumps(c))
    y = ex / "t.yaml"
    y.write_text("model: {path: ., dtype: float32, generate: {seed: 0}}\n"
                 "rollout: {engine: hf, kernels: consistent}\ntrain: {engine: hf, kernels: consistent}\n"
                 "prompts: {count: 2, min_len: 3, max_len: 6}\nsampling: {max_tokens: 4}\n"
                 "locate: {enabled: false}\n" + SMALL_PERF)
    yield y
    hf._MODELS.clear()


def ctx_of(path, **perf) -> GateContext:
    cfg = load_config(path)
    if perf:
        cfg.perf = PerfConfig(**{**cfg.perf.model_dump(), **perf})
    return GateContext(cfg)


def frozen_baseline(ctx: GateContext) -> None:
    record, requests = measure_baseline(ctx)
    bl.write_baseline(bl.baseline_dir(ctx.cfg), record, requests)
    bl.freeze(bl.baseline_dir(ctx.cfg))
    bl.approve(bl.baseline_dir(ctx.cfg), "reviewer")


# ---- C1 ------------------------------------------------------------------------------------------------------
def test_c1_needs_run_freeze_and_approval_and_fails_after_an_edit(small, tic):
    c = str(small)
    code, out, _ = tic("gate", "C1", "-c", c, "--json")
    r = json.loads(out)["results"][0]
    assert code == 4 and r["verdict"] == "waiting" and "no baseline" in r["reason"]  # a step to take, no failure
    assert tic("baseline", "run", "-c", c)[0] == 0
    d = bl.baseline_dir(load_config(small))
    reqs = [json.loads(x) for x in (d / "requests.jsonl").read_text().splitlines()]
    assert len(reqs) == 2 * 3 and {"latency_s", "output_tokens", "input_tokens"} <= set(reqs[0])
    fp = json.loads((d / "baseline.json").read_text())["fingerprint"]
    assert fp["engine"]["kernels"] == "stock" and "env" in fp["environment"] and "packages" in fp["environment"]
    code, out, _ = tic("gate", "C1", "-c", c, "--json")
    assert code == 4 and "not frozen" in json.loads(out)["results"][0]["reason"]
    assert tic("baseline", "approve", "--by", "ann", "-c", c)[0] == 2  # nothing frozen to approve
    assert tic("baseline", "freeze", "-c", c)[0] == 0
    code, out, _ = tic("gate", "C1", "-c", c, "--json")
    assert code == 4 and "not approved" in json.loads(out)["results"][0]["reason"]
    code, out, _ = tic("gate", "C10", "-c", c, "--json")
    assert code == 4 and json.loads(out)["results"][0]["verdict"] == "waiting"  # waits with C1, runs nothing
    assert tic("baseline", "approve", "--by", "ann", "-c", c)[0] == 0
    code, out, _ = tic("gate", "C1", "-c", c, "--json")
    assert code == 0, out
    assert tic("baseline", "run", "-c", c)[0] == 2  # a frozen baseline is not overwritten silently
    assert tic("baseline", "freeze", "-c", c)[0] == 2  # nor re-frozen

    # planted fault: one raw timing edited after the freeze -> C1 and C10 fail
    lines = (d / "requests.jsonl").read_text().splitlines()
    r0 = json.loads(lines[0])
    r0["latency_s"] *= 2
    (d / "requests.jsonl").write_text("\n".join([json.dumps(r0, sort_keys=True)] + lines[1:]) + "\n")
    code, out, _ = tic("gate", "C1", "-c", c, "--json")
    r = json.loads(out)["results"][0]
    assert code == 1 and r["verdict"] == "fail" and "requests.jsonl changed after the freeze" in r["reason"]
    code, out, _ = tic("gate", "C10", "-c", c, "--json")
    r = json.loads(out)["results"][0]
    assert code == 1 and r["reason"].startswith("refused: C1 baseline not valid")


def test_c1_fails_when_refrozen_after_an_edit(small):
    ctx = ctx_of(small)
    frozen_baseline(ctx)
    d = bl.baseline_dir(ctx.cfg)
    rec = json.loads((d / "baseline.json").read_text())
    rec["throughput_tok_s"]["median"] *= 0.5  # someone "slows" the baseline on paper ...
    (d / "baseline.json").write_text(json.dumps(rec))
    (d / bl.FREEZE).unlink()
    bl.freeze(d)  # ... and freezes again: the approval no longer matches
    res = run_gate(get("C1"), ctx)
    assert res.verdict == "fail" and "another baseline hash" in res.reason


# ---- C10 -----------------------------------------------------------------------------------------------------
class TokenClock:
    """A deterministic clock: each side's engine call advances it by cost x generated tokens."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def charge(self, ctx, side, cost, monkeypatch):
        eng, _ = perf_side(ctx, side)
        call = eng.generate_together

        def timed(*a, **k):
            out = call(*a, **k)
            self.t += cost * sum(len(s.response_ids) for s in out)
            return out

        monkeypatch.setattr(eng, "generate_together", timed)


@pytest.mark.parametrize("cost, verdict", [(1.0, "pass"), (1.25, "pass"), (2.0, "fail")])
def test_c10_judges_the_throughput_ratio_at_the_floor(small, monkeypatch, cost, verdict):
    from tic.harness.measure import perf

    clock = TokenClock()
    monkeypatch.setattr(perf, "CLOCK", clock)
    ctx = ctx_of(small)  # baseline: stock kernels, floor 0.70 (the default)
    frozen_baseline(ctx)
    clock.charge(ctx, "baseline", 1.0, monkeypatch)
    clock.charge(ctx, "consistent", cost, monkeypatch)  # planted: the consistent side is `cost` times slower
    res = run_gate(get("C10"), ctx)
    assert res.verdict == verdict, res.reason
    assert res.metrics["ratio_median"] == pytest.approx(1 / cost) and res.metrics["floor"] == 0.70
    assert res.metrics["pairs"] == 3 and res.metrics["c5_exact"] is True
    if verdict == "fail":
        assert "below the floor" in res.reason
    raw = (ctx.state.artifacts_dir("C10") / "requests.jsonl").read_text().splitlines()
    assert len(raw) == 2 * 3 * 2 and {json.loads(x)["side"] for x in raw} == {"baseline", "consistent"}


def test_c10_fails_when_the_consistent_rollout_is_not_diff_0(small):
    ctx = ctx_of(small, baseline={})
    ctx.cfg.rollout.kernels = "stock"  # both sides stock: fast, but rollout and recompute differ
    ctx.cfg.train.kernels = "consistent"
    frozen_baseline(ctx)
    res = run_gate(get("C10"), ctx)
    assert res.verdict == "fail" and "not diff = 0" in res.reason


def test_c10_refuses_when_a_transport_variable_differs(small):
    ctx = ctx_of(small)
    frozen_baseline(ctx)
    ctx.cfg.perf.consistent_env = {"NCCL_NET": "Socket"}  # planted: the consistent run pinned to another transport
    res = run_gate(get("C10"), ctx)
    assert res.verdict == "fail" and res.reason.startswith("refused") and "NCCL_NET" in res.reason


def test_c10_ignores_the_variables_a_compiling_engine_sets_itself(small, monkeypatch):
    """vLLM's compiler and torch write Triton's cache folder and ptxas path into the process environment once an
    in-process engine compiles: a baseline frozen before that is still the same baseline; a variable somebody set
    is still refused."""
    ctx = ctx_of(small)
    frozen_baseline(ctx)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/tmp/compiled/triton_cache")
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/opt/torch/bin/ptxas")
    res = run_gate(get("C10"), ctx)
    assert not res.reason.startswith("refused"), res.reason
    ctx.cfg.perf.consistent_env = {"TRITON_DEFAULT_FP_FUSION": "0"}  # a Triton setting chosen for one side
    res = run_gate(get("C10"), ctx)
    assert res.verdict == "fail" and res.reason.startswith("refused") and "TRITON_DEFAULT_FP_FUSION" in res.reason


def test_c10_refuses_a_baseline_changed_since_freezing(small):
    ctx = ctx_of(small)
    frozen_baseline(ctx)
    ctx2 = ctx_of(small, baseline={"kernels": "stock", "batch_size": 1})
    res = run_gate(get("C10"), ctx2)
    assert res.verdict == "fail" and "differs from the frozen one" in res.reason and "batch_size" in res.reason


# ---- C8 ------------------------------------------------------------------------------------------------------
def test_c8_two_updates_with_in_place_sync_pass(small):
    res = run_gate(get("C8"), ctx_of(small))
    assert res.verdict == "pass", res.reason
    m = res.metrics
    assert m["versions_compared"] == 3 and m["optimizer_updates_per_step"] == [1, 1] and m["storage_moved"] == 0
    assert m["unchanged_updates"] == 0


def test_the_rl_step_accumulates_micro_batches_into_one_update_of_the_mini_batch_loss(small):
    """The step holds one micro-batch's graph at a time (backward per micro-batch) and still makes one optimizer
    update whose gradient is the whole mini-batch's loss: here against that loss in one backward (float32; the
    sums differ only in order), and a plant that normalises each micro-batch by its own tokens does not match."""
    from tic.harness.measure.rl import response_logprobs, synthetic_reward

    ctx = ctx_of(small)
    ctx.cfg.prompts.count = 5
    samples = ctx.rollout_samples()
    engine = ctx.private_engine("train", "test")
    engine.micro_batch_size = 2
    adv = synthetic_reward(samples) - synthetic_reward(samples).mean()
    tokens = sum(len(s.response_ids) for s in samples)
    engine.model.requires_grad_(True)
    parts = list(response_logprobs(engine, samples, ctx.sampling))
    assert [g for g, _ in parts] == [[0, 1], [2, 3], [4]]  # the engine's micro-batches, one graph each
    whole = -sum(adv[i] * lp.sum() for g, lps in parts for i, lp in zip(g, lps)) / tokens
    want = torch.autograd.grad(whole, list(engine.model.parameters()), allow_unused=True, retain_graph=True)
    plant = -sum(adv[i] * lp.sum() / sum(len(samples[j].response_ids) for j in g)
                 for g, lps in parts for i, lp in zip(g, lps))
    planted = torch.autograd.grad(plant, list(engine.model.parameters()), allow_unused=True)
    trainer = PolicyGradientTrainer(engine, lr=0.0)
    report = trainer.step(samples, ctx.sampling)
    got = [p.grad for p in engine.model.parameters()]
    assert report.updates == 1
    pairs = [(g, w, x) for g, w, x in zip(got, want, planted) if w is not None]
    assert pairs and all(torch.allclose(g, w, rtol=1e-5, atol=1e-7) for g, w, _ in pairs)
    assert not all(torch.allclose(g, x, rtol=1e-5, atol=1e-7) for g, _, x in pairs)


def test_c8_fails_when_sync_reallocates_weights(small, monkeypatch):
    @torch.no_grad()
    def reallocating(self, weights, version):  # planted: new storage instead of a copy into the old one
        own = dict(self.model.named_parameters())
        for name, t in weights.items():
            own[name].data = t.detach().clone()
        self.weight_version = version
        return {}

    monkeypatch.setattr(HFEngine, "load_weights_inplace", reallocating)
    res = run_gate(get("C8"), ctx_of(small))
    assert res.verdict == "fail" and "re-allocated" in res.reason and res.metrics["storage_moved"] > 0


def test_c8_fails_on_a_second_update_per_step(small, monkeypatch):
    step = PolicyGradientTrainer.step

    def twice(self, samples, sampling):  # planted: the step is retried, the weights update twice
        step(self, samples, sampling)
        return step(self, samples, sampling)

    monkeypatch.setattr(PolicyGradientTrainer, "step", twice)
    res = run_gate(get("C8"), ctx_of(small))
    assert res.verdict == "fail" and "exactly 1 optimizer update" in res.reason
    assert res.metrics["optimizer_updates_per_step"][0] == 2


def test_c8_rejects_configured_mini_batch_updates(small):
    ctx = ctx_of(small)
    ctx.cfg.training.updates_per_step = 2
    ctx.cfg.training.updates = 1
    res = run_gate(get("C8"), ctx)
    assert res.verdict == "fail" and "updates_per_step = 2" in res.reason


# ---- C9 ------------------------------------------------------------------------------------------------------
def test_c9_restore_in_a_fresh_process_and_scale_up_pass(small):
    with open(small, "a") as f:
        f.write("scale_up: [{name: deeper, config: {num_hidden_layers: 2}, prompt_len: 10, max_tokens: 6}]\n")
    res = run_gate(get("C9"), ctx_of(small))
    assert res.verdict == "pass", res.reason
    m = res.metrics
    assert m["update_identical"] and m["rollout_identical"] and m["restored_exact"] and m["exact_stages"] == 1
    assert res.details["restore"]["restore"]["optimizer_state"] is True
    assert res.details["stages"][0]["layers"] == 2 and res.details["stages"][0]["prompt_len"] == 10


def test_c9_fails_when_the_restore_drops_optimizer_state(small, monkeypatch):
    monkeypatch.setenv("TIC_PRELOAD", "tic_fault_drop_optimizer_state")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(SUPPORT), os.environ.get("PYTHONPATH")])))
    res = run_gate(get("C9"), ctx_of(small))
    assert res.verdict == "fail" and "first update after restore differs" in res.reason, res.reason
    assert res.metrics["rollout_identical"] and res.metrics["restored_exact"]  # only the update differs


def test_c9_without_scale_up_stages_does_not_pass(small, monkeypatch):
    # the restore part stands in as identical: only the missing scale-up list is judged here
    ctx = ctx_of(small)
    from tic.gates import c9

    monkeypatch.setattr(c9, "_restore", lambda ctx: ({
        "before_checkpoint_exact": True, "uninterrupted_exact": True, "restored_exact": True, "restored_diff": "",
        "restored_sync_ok": True, "restored_optimizer_updates": 1, "restore": {}, "rollout_differs": [],
        "update_differs": [], "checkpoint": ""}, None))
    res = run_gate(get("C9"), ctx)
    assert res.verdict == "fail" and "scale_up lists no stage" in res.reason


def test_rl_gates_stop_early_when_diff_is_not_0_before_any_update(small):
    ctx = ctx_of(small)
    ctx.cfg.rollout.kernels = "stock"  # stock kernels: rollout and recompute already differ at version 0
    r8, r9 = run_gate(get("C8"), ctx), run_gate(get("C9"), ctx)
    assert r8.verdict == "fail" and r8.metrics["versions_compared"] == 1 and "weight version 0" in r8.reason
    assert r9.verdict == "fail" and "not diff = 0" in r9.reason and r9.metrics["stages"] == 0


@pytest.mark.parametrize("refresh", [True, False])
def test_c8_weight_derived_tensors_must_be_recomputed(small, monkeypatch, refresh):
    """The rollout head runs from a derived copy of its weight (as fused or quantized weights are): a sync that
    rebuilds it passes; one that leaves it stale fails at the first new weight version."""
    from tic.harness.kernels.consistent_cpu import row_linear

    build = GateContext.private_engine

    def with_derived_head(self, side, gate):
        eng = build(self, side, gate)
        if side == "rollout":
            head = eng.model.lm_head
            head.derived = head.weight.detach().clone()
            head.forward = lambda x: row_linear(x, head.derived)
            if refresh:
                head.tic_refresh_derived = lambda: head.derived.copy_(head.weight.detach())
        return eng

    monkeypatch.setattr(GateContext, "private_engine", with_derived_head)
    res = run_gate(get("C8"), ctx_of(small))
    if refresh:
        assert res.verdict == "pass", res.reason
        assert res.details["syncs"][0]["refreshed"] == ["lm_head"]
    else:
        assert res.verdict == "fail" and "weight version 1" in res.reason


def test_rl_gates_are_unavailable_without_in_place_weight_sync(small, monkeypatch):
    def no_sync(self):  # as an engine whose weight sync is not wired (vLLM today)
        raise NotImplementedError("engine 'x' has no in-place weight sync")

    monkeypatch.setattr(HFEngine, "weight_storage", no_sync)
    for g in ("C8", "C9"):
        res = run_gate(get(g), ctx_of(small))
        assert res.verdict == "unavailable" and "in-place weight sync" in res.reason


# ---- vLLM weight sync, against a stand-in of vLLM's fused loaders ---------------------------------------------
class _FusedModel(torch.nn.Module):
    """Like a vLLM model: q/k/v stored as one fused parameter, filled by load_weights from checkpoint names."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(6, 4), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(4), requires_grad=False)

    def load_weights(self, weights):
        rows = {"q.weight": slice(0, 2), "k.weight": slice(2, 4), "v.weight": slice(4, 6)}
        loaded = set()
        for name, t in weights:
            if name in rows:
                self.qkv.data[rows[name]].copy_(t)
                loaded.add("qkv")
            elif name == "norm.weight":
                self.norm.data.copy_(t)
                loaded.add("norm")
        return loaded


def _vllm_standin(model, quantization=None):
    from types import SimpleNamespace

    from tic.harness.engines.vllm import VLLMEngine

    eng = object.__new__(VLLMEngine)
    eng.llm = SimpleNamespace(apply_model=lambda fn: [fn(model)], reset_prefix_cache=lambda: True,
                              model_config=SimpleNamespace(quantization=quantization, dtype=torch.bfloat16))
    return eng


def test_vllm_weight_sync_copies_through_the_models_loaders_in_place_and_checks_every_parameter():
    model = _FusedModel()
    eng = _vllm_standin(model)
    g = torch.Generator().manual_seed(0)
    w = {"q.weight": torch.randn(2, 4, generator=g), "k.weight": torch.randn(2, 4, generator=g),
         "v.weight": torch.randn(2, 4, generator=g), "norm.weight": torch.randn(4, generator=g)}
    before = eng.weight_storage()
    assert eng.unequal_weights(w) == ["norm", "qkv"]  # nothing synced yet
    rep = eng.load_weights_inplace(w, 3)
    assert eng.weight_storage() == before and rep["version"] == 3 and eng.weight_version == 3
    assert torch.equal(model.qkv[2:4], w["k.weight"])
    assert eng.unequal_weights(w) == []
    assert eng.weight_storage() == before  # the check's scratch copies left the live storage in place
    # planted: one element of one fused slice differs after the sync
    model.qkv.data[5, 1] += 1
    assert eng.unequal_weights(w) == ["qkv"]
    # planted: the trainer's weights do not reach a parameter
    partial = {k: v for k, v in w.items() if k != "norm.weight"}
    assert eng.unequal_weights(partial) == ["norm (not reached by the trainer's weights)", "qkv"]


class _QuantizedModel(torch.nn.Module):
    """Like a vLLM block-FP8 model after loading: its parameters were replaced by processed ones (here the codes
    as stored times a per-tensor scale, and a buffer of the scale), so its loaders no longer work in place; a
    stand-in of vLLM's layerwise reload rebuilds them from checkpoint tensors, processes, and copies into the same
    storage."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2, 4), requires_grad=False)
        self.register_buffer("scale", torch.zeros(1))
        self.reloading = False

    def load_weights(self, weights):
        if not self.reloading:
            raise AttributeError("'Parameter' object has no attribute 'load_row_parallel_weight'")
        self.pending = dict(weights)
        return {"w"}


def _fake_reload_module(calls):
    from types import ModuleType

    mod = ModuleType("vllm.model_executor.model_loader.reload")

    def initialize_layerwise_reload(model):
        calls.append("initialize")
        model.reloading = True

    def finalize_layerwise_reload(model, model_config):
        calls.append(("finalize", model_config.dtype))
        w = model.pending
        if "w.weight" in w:  # processing: codes times their scale, written into the existing storage
            model.w.data.copy_(w["w.weight"] * w["w.weight_scale_inv"])
            model.scale.data.copy_(w["w.weight_scale_inv"])
        model.reloading = False

    mod.initialize_layerwise_reload = initialize_layerwise_reload
    mod.finalize_layerwise_reload = finalize_layerwise_reload
    return mod


def test_vllm_weight_sync_of_a_quantized_model_goes_through_vllms_layerwise_reload(monkeypatch):
    import sys

    calls = []
    monkeypatch.setitem(sys.modules, "vllm.model_executor.model_loader.reload", _fake_reload_module(calls))
    model = _QuantizedModel()
    eng = _vllm_standin(model, quantization="fp8")
    w = {"w.weight": torch.arange(8.0).reshape(2, 4), "w.weight_scale_inv": torch.tensor([0.5])}
    before, scale_before = eng.weight_storage(), model.scale.clone()
    assert eng.unequal_weights(w) == ["w"]  # nothing synced yet
    assert torch.equal(model.scale, scale_before)  # the check's reprocessing wrote into scratch buffers only
    eng.load_weights_inplace(w, 1)
    assert calls[-2:] == ["initialize", ("finalize", torch.bfloat16)]
    assert eng.weight_storage() == before and torch.equal(model.w, torch.arange(8.0).reshape(2, 4) * 0.5)
    assert eng.unequal_weights(w) == []
    model.w.data[1, 3] += 1  # planted: one processed element differs from what the trainer's tensors give
    assert eng.unequal_weights(w) == ["w"]
    # the unquantized path keeps the model's own loaders (a quantized model's loaders are gone)
    with pytest.raises(AttributeError, match="load_row_parallel_weight"):
        _vllm_standin(model).load_weights_inplace(w, 2)


def test_checkpoint_weights_are_the_saved_checkpoints_names_and_values(example):
    """vLLM gets the trainer's weights as a checkpoint has them (per-expert tensors for a MoE model)."""
    from safetensors.torch import load_file

    from tic.harness.model.generate import generate_model

    ex = example("tiny-qwen3-moe")
    hf._MODELS.clear()
    full = generate_model(ex, seed=0, out_dir=ex / "weights")
    eng = HFEngine(full, "float32", "consistent", device="cpu", shared_model=False)
    trainer = PolicyGradientTrainer(eng, 1e-3, 1)
    disk = {}
    for f in full.glob("*.safetensors"):
        disk.update(load_file(str(f)))
    got = trainer.checkpoint_weights()
    assert sorted(got) == sorted(disk) and all(torch.equal(got[k].float(), disk[k].float()) for k in disk)
    assert any(".experts." in k for k in got) and sorted(trainer.weights()) != sorted(got)
    hf._MODELS.clear()


def test_vllm_baseline_side_is_vllm_with_its_defaults_in_an_engine_process_of_its_own(example, workdir):
    """The consistent side keeps its mode settings; the baseline drops them and the switch, and both sides keep
    what C1/C10 need of either (an engine core of its own) and every other option."""
    from tic.harness.measure.perf import side_config

    ex = example("tiny-qwen3")
    (ex / "v.yaml").write_text(
        "model: {path: ., generate: {seed: 0}}\n"
        "rollout: {engine: vllm, patches: [gemm-fixed-m], options: {enforce_eager: false, compilation_config: "
        "{mode: 0}, cudagraph_mode: FULL_DECODE_ONLY, max_num_seqs: 32}}\n")
    cfg = load_config(ex / "v.yaml")
    (cons, _), (base, _) = (side_config(cfg.rollout, cfg.perf, which) for which in ("consistent", "baseline"))
    assert cons.patches == ["gemm-fixed-m"] and cons.options["compilation_config"] == {"mode": 0}
    assert base.patches == [] and base.options == {"enforce_eager": False, "max_num_seqs": 32,
                                                   "engine_process": "own", "batch_invariant": False}
    assert cons.options["engine_process"] == "own"


def test_c9_key_figure_names_only_what_ran():
    from tic.gates.base import Measurement
    from tic.gates.c9 import judge

    base = {"restored_exact": True, "update_identical": True, "rollout_identical": True, "restored_sync_ok": True,
            "restored_optimizer_updates": 1, "stages": 2, "exact_stages": 2, "stages_configured": 2}
    restore = {"first_diff": "token 3", "restored_diff": "", "rollout_differs": [], "update_differs": [],
               "restore": {}}

    def key(**metrics):
        return judge(Measurement(metrics={**base, **metrics}, details={"restore": restore, "stages": []})).key_figure

    assert key(uninterrupted_exact=True) == "restore identical, 2/2 scale-up stages diff = 0"
    nothing_ran = key(uninterrupted_exact=False, stages=0, exact_stages=0)
    assert "identical" not in nothing_ran and "0/0" not in nothing_ran and "not run" in nothing_ran
    assert key(uninterrupted_exact=True, stages=0, exact_stages=0, stages_configured=0).endswith("no scale-up "
                                                                                                 "stage configured")
