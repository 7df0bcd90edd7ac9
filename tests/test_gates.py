"""Every implemented gate: a planted divergence that must fail it, and a control that must pass it."""

import json

import pytest
import torch

from tic.gates import get
from tic.harness.engines import hf
from tic.config.schema import TrainLayout, load_config
from tic.skill.context import GateContext
from tic.skill.runner import run_gate


@pytest.fixture
def consistent_ctx(example, workdir):
    hf._MODELS.clear()  # planted models must not leak between tests
    ex = example("tiny-qwen3")
    cfg = load_config(ex / "tic-consistent.yaml")
    cfg.prompts.count = 5
    cfg.sampling.max_tokens = 8
    cfg.layouts.batch_sizes = [3]
    cfg.layouts.probes = 1
    cfg.locate.enabled = False
    yield GateContext(cfg)
    hf._MODELS.clear()


def wrap_forward(module, fn):
    orig = module.forward

    def forward(x, *a, **k):
        return fn(x, orig(x, *a, **k))

    module.forward = forward


def bf16_round(out):
    return out.to(torch.bfloat16).to(out.dtype)


# ---- C0 -----------------------------------------------------------------------------------------------------
def test_c0_inventory_passes(example, workdir, tic):
    ex = example("tiny-qwen3-moe")
    code, out, _ = tic("gate", "C0", "-c", str(ex / "tic.yaml"), "--json")
    rec = json.loads(out)["results"][0]
    assert code == 0 and rec["verdict"] == "pass"
    manifest = json.loads((ex / ".tic/artifacts/C0/manifest.json").read_text())  # .tic/ beside tic.yaml
    assert [L["mlp"] for L in manifest["layers"]] == ["dense", "moe", "moe", "moe"]
    assert "mlp:moe" in manifest["operator_classes"] and manifest["dtypes"] == ["F32"]


@pytest.mark.parametrize("extra, why", [
    ("rollout: {tensor_parallel_size: 2}", "TP>1"),
    ("train: {parallel: {tp: 2, dp: 2, ep: 4}}", "train.parallel.tp=2: TP>1"),
    ("rollout: {parallel: {tp: 2, dcp: 2}}", "decode context parallel"),
    ("rollout: {parallel: {dp: 2, ep: 2}, options: {expert_combine: rank_partials}}", "expert_combine"),
    ("training: {updates_per_step: 4}", "updates_per_step=4"),
    ("training: {speculative_decoding: true}", "speculative"),
    ("rollout: {engine: vllm, options: {batch_invariant: true}}", "tic's patches replace it"),
])
def test_c0_rejects_uncovered_setups(example, workdir, tic, extra, why):
    ex = example("tiny-qwen3")
    cfg = ex / "bad.yaml"
    cfg.write_text("model: {path: ., generate: {seed: 0}}\n" + extra + "\n")
    code, out, _ = tic("gate", "C0", "-c", str(cfg), "--json")
    rec = json.loads(out)["results"][0]
    assert code == 1 and rec["verdict"] == "fail" and why in rec["reason"]


def test_c0_names_the_module_the_kernel_wrappers_do_not_cover(workdir, tic):
    """A q/k norm over a width that is neither one head nor the whole projection (here an OLMoE whose head_dim
    makes the projections 32 wide while its norms stay hidden_size 64): C0 names the modules, their class and
    what the wrappers lack (one entry for all layers), before any gate builds the model."""
    cfg = {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "vocab_size": 128, "hidden_size": 64,
           "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
           "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 256}
    (workdir / "olmoe").mkdir()
    (workdir / "olmoe" / "config.json").write_text(json.dumps(cfg))
    for kernels, refused in (("consistent", True), ("stock", False)):
        (workdir / "t.yaml").write_text(f"model: {{path: olmoe, generate: {{seed: 0}}}}\ntrain: {{kernels: {kernels}}}\n")
        code, out, _ = tic("gate", "C0", "-c", str(workdir / "t.yaml"), "--json")
        rec = json.loads(out)["results"][0]
        assert (rec["verdict"] == "fail") is refused and code == (1 if refused else 0), rec["reason"]
        if refused:
            assert ("model.layers.{0,1}.self_attn.q_norm (OlmoeRMSNorm): a norm over 64 features; the wrappers "
                    "normalise each head (8) or the whole projection (32)") in rec["reason"]


# ---- C3/C4/C5 controls: consistent kernels pass --------------------------------------------------------------
@pytest.mark.parametrize("gate", ["C3", "C4", "C5", "C6"])
def test_consistent_kernels_pass(consistent_ctx, gate):
    res = run_gate(get(gate), consistent_ctx)
    assert res.verdict == "pass", res.reason


def test_consistent_moe_passes_c5(example, workdir):
    hf._MODELS.clear()
    cfg = load_config(example("tiny-qwen3-moe") / "tic-consistent.yaml")
    cfg.prompts.count, cfg.sampling.max_tokens, cfg.train.packing = 4, 8, True
    assert run_gate(get("C5"), GateContext(cfg)).verdict == "pass"


# ---- planted divergences on top of the consistent kernels ----------------------------------------------------
def test_c3_fails_on_a_batch_dependent_kernel(consistent_ctx):
    model = consistent_ctx.rollout_engine().model
    # layer 1's MLP rounds through bf16 only when more than one request is in the batch
    wrap_forward(model.model.layers[1].mlp, lambda x, out: bf16_round(out) if x.shape[0] > 1 else out)
    res = run_gate(get("C3"), consistent_ctx)
    assert res.verdict == "fail" and res.metrics["identical_requests"] < res.metrics["comparisons"]


def test_c4_fails_on_a_phase_dependent_kernel(consistent_ctx):
    model = consistent_ctx.rollout_engine().model
    # layer 2's MLP rounds through bf16 only on single-token (decode) steps
    wrap_forward(model.model.layers[2].mlp, lambda x, out: bf16_round(out) if x.shape[1] == 1 else out)
    res = run_gate(get("C4"), consistent_ctx)
    assert res.verdict == "fail" and res.metrics["equal_fraction"] < 1 and res.metrics["max"] > 0


def test_c5_fails_when_training_changes_one_norm_eps(consistent_ctx):
    consistent_ctx.rollout_engine()
    hf._MODELS.clear()  # the train side gets its own model object
    train = consistent_ctx.train_engine()
    train.model.model.layers[3].post_attention_layernorm.variance_epsilon = 1e-5
    res = run_gate(get("C5"), consistent_ctx)
    assert res.verdict == "fail" and res.metrics["first_mismatch"] is not None
    assert res.metrics["k3_kl"] != 0 or res.metrics["max"] > 0


def test_c6_fails_when_training_depends_on_its_micro_batch(consistent_ctx):
    consistent_ctx.rollout_engine()
    hf._MODELS.clear()  # the train side (all its layouts share this model) gets its own model object
    model = consistent_ctx.train_engine().model
    # layer 0's MLP rounds through bf16 only when a forward holds more than one sequence
    wrap_forward(model.model.layers[0].mlp, lambda x, out: bf16_round(out) if x.shape[0] > 1 else out)
    consistent_ctx.cfg.locate.enabled = True
    res = run_gate(get("C6"), consistent_ctx)
    assert res.verdict == "fail" and res.metrics["identical_layouts"] < res.metrics["layouts"]
    assert res.metrics["first_mismatch"]["layout"] == {"micro_batch_size": 1}
    loc = res.details["locate"]
    assert loc["first_divergent_layer"] == "model.layers.0" and loc["culprit_module"] == "model.layers.0.mlp"


@pytest.mark.parametrize("order", ["reversed", "shuffled"])
def test_c6_sequence_order_catches_a_result_that_depends_on_a_sequences_row_in_its_micro_batch(consistent_ctx,
                                                                                              order):
    """Only the order changes: each micro-batch keeps 4 sequences, so a fault tied to the row a sequence lands in
    (not to the batch size) is what the order layout alone must catch; the locator rebuilds that micro-batch."""
    consistent_ctx.cfg.layouts.train = [TrainLayout(order=order)]
    consistent_ctx.rollout_engine()
    hf._MODELS.clear()
    model = consistent_ctx.train_engine().model

    def second_row_rounded(x, out):  # layer 0's MLP rounds through bf16 for whichever sequence is in row 1
        if x.shape[0] > 1:
            out = out.clone()
            out[1] = bf16_round(out[1])
        return out

    wrap_forward(model.model.layers[0].mlp, second_row_rounded)
    consistent_ctx.cfg.locate.enabled = True
    res = run_gate(get("C6"), consistent_ctx)
    assert res.verdict == "fail" and res.metrics["first_mismatch"]["layout"] == {"order": order}
    loc = res.details["locate"]
    assert loc["first_divergent_layer"] == "model.layers.0" and loc["culprit_module"] == "model.layers.0.mlp"


def test_c6_sequence_order_passes_with_row_invariant_kernels(consistent_ctx):
    consistent_ctx.cfg.layouts.train = [TrainLayout(order="shuffled"), TrainLayout(order="reversed")]
    res = run_gate(get("C6"), consistent_ctx)
    assert res.verdict == "pass" and res.metrics["identical_layouts"] == 2, res.reason


def test_sequence_orders_are_fixed_permutations():
    from tic.harness.engines.batches import micro_batches, sequence_order

    for n in (0, 1, 5, 48):
        for order in ("given", "reversed", "shuffled"):
            idx = sequence_order(n, order)
            assert sorted(idx) == list(range(n)) and idx == sequence_order(n, order)
    for n in (2, 5, 48):  # shuffled moves every sequence
        assert all(i != j for i, j in enumerate(sequence_order(n, "shuffled")))
    assert sequence_order(5, "reversed") == [4, 3, 2, 1, 0]
    assert micro_batches(5, 2, "reversed") == [[4, 3], [2, 1], [0]]
    with pytest.raises(ValueError):
        sequence_order(3, "sorted")


# ---- stock kernels: the real CPU divergences -----------------------------------------------------------------
@pytest.mark.slow
def test_stock_ladder_reports_real_divergences(example, workdir, tic, tmp_path):
    hf._MODELS.clear()
    ex = example("tiny-qwen3")
    junit = tmp_path / "junit.xml"
    code, out, err = tic("ladder", "-c", str(ex / "tic.yaml"), "--keep-going", "--json", "--junit", str(junit))
    rec = {r["gate"]: r for r in json.loads(out)["results"]}
    assert code == 1
    assert rec["C0"]["verdict"] == "pass"
    for g in ("C3", "C4", "C5", "C6"):
        assert rec[g]["verdict"] == "fail", rec[g]["reason"]
    assert 0 < rec["C5"]["metrics"]["equal_fraction"] < 1
    assert rec["C2"]["verdict"] == "pass"
    assert rec["C7"]["verdict"] == "fail" and "train.kernels is stock" in rec["C7"]["reason"]
    assert rec["C1"]["verdict"] == "waiting" and "no baseline" in rec["C1"]["reason"]
    for g in ("C8", "C9"):  # not diff = 0 before any update: they stop at the first compare
        assert rec[g]["verdict"] == "fail", rec[g]["reason"]
        assert "not diff = 0" in rec[g]["reason"] or "version 0" in rec[g]["reason"]
    assert rec["C10"]["verdict"] == "waiting" and rec["C10"]["reason"].startswith("waiting for C1: C1 baseline")
    assert "<testsuite" in junit.read_text() and "failure" in junit.read_text()
    assert "C5" in err  # the table goes to stderr


@pytest.mark.slow
def test_consistent_ladder_exits_0_over_c3_c7(example, workdir, tic):
    hf._MODELS.clear()
    ex = example("tiny-qwen3")
    code, _, err = tic("ladder", "-c", str(ex / "tic-consistent.yaml"), "--from", "C3", "--to", "C7")
    assert code == 0, err


def test_ladder_stops_at_first_failure_without_keep_going(example, workdir, tic):
    hf._MODELS.clear()
    ex = example("tiny-qwen3")
    code, out, _ = tic("ladder", "-c", str(ex / "tic.yaml"), "--from", "C3", "--to", "C5", "--json")
    v = [r["verdict"] for r in json.loads(out)["results"]]
    assert code == 1 and v == ["fail", "skipped", "skipped"]


def test_unavailable_gate_is_never_a_pass(example, workdir, monkeypatch):
    from tic.gates.base import Gate
    from tic.skill.runner import exit_code

    declared = Gate(id="C8", title="declared only", step=4, measures="", pass_condition="", inputs=[],
                    artifacts=[], guide="", implemented_by="a later release")
    ctx = GateContext(load_config(example("tiny-qwen3") / "tic.yaml"))
    r = run_gate(declared, ctx)
    assert r.verdict == "unavailable" and "later release" in r.reason and exit_code([r]) == 1


def test_a_gate_that_cannot_measure_here_is_unavailable_and_never_judged(example, workdir):
    from tic.gates.base import Gate, Judgement, Measurement
    from tic.skill.runner import exit_code

    def judge(m):
        raise AssertionError("a measurement of nothing was judged")

    gate = Gate(id="C8", title="cannot here", step=4, measures="", pass_condition="", inputs=[], artifacts=[],
                guide="", measure=lambda ctx: Measurement(unavailable="this engine cannot"), judge=judge,
                needs_model=False)
    r = run_gate(gate, GateContext(load_config(example("tiny-qwen3") / "tic.yaml")), save=False)
    assert r.verdict == "unavailable" and r.reason == "this engine cannot" and exit_code([r]) == 1
    assert json.loads(r.model_dump_json())["verdict"] == "unavailable"  # records keep the plain value
    with pytest.raises(ValueError, match="pass, fail or waiting"):  # unavailable is said one way: by the measurement
        Judgement("unavailable", "a judge may not say it")


def test_plain_ladder_climbs_past_a_waiting_c1(example, workdir, tic):
    """C1 without a baseline waits (a step to take, not a failure): the climb goes on past it, exit 4."""
    hf._MODELS.clear()
    ex = example("tiny-qwen3")
    code, out, err = tic("ladder", "-c", str(ex / "tic.yaml"), "--to", "C2", "--json")
    v = {r["gate"]: r["verdict"] for r in json.loads(out)["results"]}
    assert code == 4 and v == {"C0": "pass", "C1": "waiting", "C2": "pass"}, out
    assert "waiting" in err and "tic baseline run" in err


def test_a_failure_outranks_waiting_in_the_exit_code():
    from tic.skill.records import GateResult
    from tic.skill.runner import exit_code

    def res(*verdicts):
        return [GateResult(gate=f"C{i}", title="", verdict=v, reason="") for i, v in enumerate(verdicts)]

    assert exit_code(res("pass", "waiting")) == 4
    assert exit_code(res("pass", "waiting", "fail")) == 1
    assert exit_code(res("waiting", "skipped")) == 1
    assert exit_code(res("waiting", "error")) == 3
    assert exit_code(res("pass")) == 0
