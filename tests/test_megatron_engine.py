"""train.engine megatron: a Megatron-core GPTModel whose layers run tic's kernel wrappers through Megatron's module
specs. Fidelity against the HF model, C5/C6 bitwise against an HF rollout on the consistent CPU kernels (and a
planted divergence that must fail C5), refusals, and gradients under the checkpoint's names."""

import pytest
import torch

pytest.importorskip("megatron.core")

from tic.config.schema import EngineConfig, load_config  # noqa: E402
from tic.core.errors import TicInputError  # noqa: E402
from tic.gates import get  # noqa: E402
from tic.harness.engines import hf  # noqa: E402
from tic.harness.engines.megatron import load_megatron_model  # noqa: E402
from tic.harness.kernels.spec import RolloutKernels  # noqa: E402
from tic.harness.testing.tinymodels import tiny_model  # noqa: E402
from tic.skill.context import GateContext  # noqa: E402
from tic.skill.runner import run_gate  # noqa: E402

# Megatron (tic specs, consistent kernels) vs stock transformers in float32: the same math in other kernels, so
# close but not equal; measured max |diff| of the logits 2.7e-7 on these models (a fidelity check, not a gate)
FIDELITY_ATOL = 1e-5


def _batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (3, 11), generator=g)
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    mask[2, 7:] = 0  # right padding
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe"])
def test_forward_matches_hf(family):
    model_dir, cfg = tiny_model(11, family)
    mg = load_megatron_model(model_dir, "float32", "consistent", "cpu", RolloutKernels(), None)
    wrapped = hf.load_model(model_dir, "float32", "consistent", shared=False)
    stock = hf.load_model(model_dir, "float32", "stock", "eager", shared=False)
    ids, mask, pos = _batch(cfg["vocab_size"])
    with torch.no_grad():
        got, same_kernels, plain = (m(input_ids=ids, attention_mask=mask, position_ids=pos).logits[mask.bool()]
                                    for m in (mg, wrapped, stock))
    assert torch.equal(got, same_kernels)
    assert (got - plain).abs().max() < FIDELITY_ATOL


@pytest.fixture
def megatron_ctx(example, workdir):
    def make(name="tiny-qwen3", **train):
        hf._MODELS.clear()
        cfg = load_config(example(name) / "tic-consistent.yaml")
        cfg.prompts.count, cfg.sampling.max_tokens, cfg.locate.enabled = 4, 8, False
        cfg.train = EngineConfig.model_validate({**cfg.train.model_dump(), "engine": "megatron", **train})
        return GateContext(cfg)
    yield make
    hf._MODELS.clear()


@pytest.mark.parametrize("name,gate", [("tiny-qwen3", "C5"), ("tiny-qwen3", "C6"), ("tiny-qwen3-moe", "C5")])
def test_consistent_rollout_and_megatron_train_pass(megatron_ctx, name, gate):
    res = run_gate(get(gate), megatron_ctx(name))
    assert res.verdict == "pass", res.reason


def test_c5_fails_when_one_megatron_norm_differs(megatron_ctx):
    ctx = megatron_ctx()
    ctx.train_engine().model.gpt.decoder.layers[1].pre_mlp_layernorm.eps = 1e-3
    res = run_gate(get("C5"), ctx)
    assert res.verdict == "fail" and res.metrics["first_mismatch"] is not None


@pytest.mark.parametrize("train,why", [({"parallel": {"tp": 2}}, "tensor, data, expert and context parallel 1"),
                                      ({"kernels": "stock"}, "kernels consistent or vllm")])
def test_tensor_parallel_and_stock_kernels_are_refused(megatron_ctx, train, why):
    with pytest.raises(TicInputError, match=why):
        megatron_ctx(**train).train_engine()


def test_policy_gradients_carry_checkpoint_names(megatron_ctx):
    ctx = megatron_ctx()
    samples = ctx.rollout_engine().generate([[3, 4, 5, 6], [7, 8, 9]], ctx.sampling, [0, 1])
    adv = [1.0, -0.5]
    got = ctx.train_engine().policy_gradients(samples, ctx.sampling, adv)
    want = hf.HFEngine(ctx.model.dir, "float32", "consistent").policy_gradients(samples, ctx.sampling, adv)
    assert set(got) == set(want)
    assert all(torch.allclose(got[k], want[k], rtol=0, atol=1e-6) for k in want)


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_c7_checks_megatron_gradients_against_the_reference(megatron_ctx, name):
    res = run_gate(get("C7"), megatron_ctx(name))
    assert res.verdict == "pass", res.reason
    assert res.metrics["tensors"] > 0


def test_c0_lists_the_megatron_limits(megatron_ctx):
    res = run_gate(get("C0"), megatron_ctx(parallel={"dp": 2, "ep": 2}))
    assert res.verdict == "fail"
    assert any("train.engine megatron runs one process" in r for r in res.details["rejected"])


def test_cli_refuses_a_megatron_rollout_and_tp_before_writing(example, workdir, tic):
    ex = example("tiny-qwen3")
    text = (ex / "tic-consistent.yaml").read_text()
    for old, new, why in (("train:\n  engine: hf", "train:\n  engine: megatron\n  parallel: {tp: 2}", "TP>1"),
                          ("rollout:\n  engine: hf", "rollout:\n  engine: megatron", "megatron is a train engine")):
        (ex / "m.yaml").write_text(text.replace(old, new).replace("state_dir: .tic-consistent", "state_dir: .tic-m"))
        code, _, err = tic("gate", "C5", "-c", str(ex / "m.yaml"))
        assert code == 2 and why in err, err
        assert not (ex / ".tic-m").exists()


def test_c8_syncs_megatron_weights_into_the_rollout(megatron_ctx):
    ctx = megatron_ctx()
    ctx.cfg.training.updates = 2
    res = run_gate(get("C8"), ctx)
    assert res.verdict == "pass", res.reason


def test_c8_fails_when_the_export_is_not_the_trainers_weights(megatron_ctx, monkeypatch):
    from tic.harness.engines.megatron import MegatronCausalLM

    real = MegatronCausalLM.hf_weights

    def off_by_one_ulp(self):  # the sync hands the rollout a final norm one ulp away from the trainer's
        out = real(self)
        out["model.norm.weight"] = torch.nextafter(out["model.norm.weight"], torch.tensor(float("inf")))
        return out

    monkeypatch.setattr(MegatronCausalLM, "hf_weights", off_by_one_ulp)
    ctx = megatron_ctx()
    ctx.cfg.training.updates = 2
    assert run_gate(get("C8"), ctx).verdict == "fail"


def test_layouts_share_one_megatron_model_and_private_engines_get_their_own(megatron_ctx):
    """As the hf engine's: C6's layouts score through the run's one model, the trainable copy is one per
    configuration, and an engine C8/C9 update loads its own (a real shape has room for no more)."""
    ctx = megatron_ctx()
    train = ctx.train_engine()
    layout = ctx.train_layout_engine({"micro_batch_size": 1})
    own = ctx.private_engine("train", "C8")
    assert layout.model is train.model and own.model is not train.model
    assert train.trainable_model() is layout.trainable_model() is not train.model
    samples = ctx.rollout_samples()
    grads = train.policy_gradients(samples, ctx.sampling, [1.0] * len(samples))
    # the result is the host copies; the device's gradients are released for the gates that follow
    assert any(g.abs().sum() > 0 for g in grads.values())
    assert all(p.grad is None for p in train.trainable_model().parameters())
