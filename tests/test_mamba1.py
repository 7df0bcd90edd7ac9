"""Mamba-1 (selective scan) mixers on tic's consistent CPU kernels: the scan decodes a token with the bits its
prefill gives, the tiny Mamba-1 example passes C2-C7, a decode step summed in another order fails C4, and only
the consistent kernels cover the mixer (C0's refusal of a vLLM rollout: tests/test_hybrid.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tic.config.schema import load_config
from tic.gates import get
from tic.harness.engines import hf
from tic.harness.kernels.coverage import coverage_problems
from tic.harness.kernels.mamba import cpu_mamba1_scan
from tic.harness.kernels.routing import Routing
from tic.harness.testing.mamba_plants import plant_matmul_decode1
from tic.skill.context import GateContext
from tic.skill.runner import run_gate

I, N = 6, 5


def _inputs(n: int, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return (r(n, I), r(n, I), r(n, N), r(n, N), r(n, I), torch.log(1 + 4 * torch.rand(I, N, generator=g)), r(I),
            0.5 * r(I))


def _closed_form(u, dt_raw, B, C, z, A_log, D, dt_bias):
    """y_t = C_t . sum_{s<=t} exp(A (dt_{s+1} + .. + dt_t)) dt_s u_s B_s + D u_t, gated: float64, no recurrence."""
    A = -torch.exp(A_log.double())
    dt = F.softplus(dt_raw.double() + dt_bias.double())
    L = torch.cumsum(dt[..., None] * A, dim=0)
    ys = []
    for t in range(u.shape[0]):
        S = sum(torch.exp(L[t] - L[s]) * (dt[s] * u[s].double())[:, None] * B[s].double()[None] for s in range(t + 1))
        ys.append(((S * C[t].double()).sum(-1) + D.double() * u[t].double()) * F.silu(z[t].double()))
    return torch.stack(ys)


def test_scan_decodes_a_token_with_its_prefill_bits():
    u, dt, B, C, z, A_log, D, bias = _inputs(9)
    zero = torch.zeros(I, N)
    full, _ = cpu_mamba1_scan(u, dt, B, C, z, A_log, D, bias, zero)
    for prefix in (1, 4):
        y, S = cpu_mamba1_scan(u[:prefix], dt[:prefix], B[:prefix], C[:prefix], z[:prefix], A_log, D, bias, zero)
        ys = [y]
        for t in range(prefix, 9):
            y, S = cpu_mamba1_scan(u[t:t + 1], dt[t:t + 1], B[t:t + 1], C[t:t + 1], z[t:t + 1], A_log, D, bias, S)
            ys.append(y)
        assert torch.equal(torch.cat(ys), full)
    assert torch.allclose(full.double(), _closed_form(u, dt, B, C, z, A_log, D, bias), atol=1e-5, rtol=1e-5)


def _small_ctx(example, name: str):
    """The example's consistent config with a small workload, the locator off."""
    hf._MODELS.clear()
    cfg = load_config(example(name) / "tic-consistent.yaml")
    cfg.prompts.count, cfg.sampling.max_tokens = 5, 10
    cfg.layouts.batch_sizes, cfg.layouts.probes = [3], 1
    cfg.locate.enabled = False
    return GateContext(cfg)


@pytest.fixture
def mamba1_ctx(example, workdir):
    yield _small_ctx(example, "tiny-mamba")
    hf._MODELS.clear()


def test_mamba1_passes_c2_to_c7(mamba1_ctx):
    for gate in ("C2", "C3", "C4", "C5", "C6", "C7"):
        res = run_gate(get(gate), mamba1_ctx)
        assert res.verdict == "pass", (gate, res.reason)


def test_c4_fails_when_one_mixer_sums_its_decode_in_another_order(mamba1_ctx):
    model = mamba1_ctx.rollout_engine().model
    plant_matmul_decode1(model.backbone.layers[1].mixer)
    res = run_gate(get("C4"), mamba1_ctx)
    assert res.verdict == "fail" and res.metrics["equal_fraction"] < 1, res.reason


def test_both_providers_cover_the_mamba1_mixer(example):
    """kernels: vllm runs the Mamba-1 scan on vLLM's decode kernel token by token (tests/test_mamba_vllm.py)."""
    ctx = GateContext(load_config(example("tiny-mamba") / "tic-consistent.yaml"))
    model = hf.load_model(ctx.model.dir, "float32", kernels="stock", shared=False)
    assert coverage_problems(model, "consistent") == coverage_problems(model, "vllm") == []



@pytest.mark.parametrize("planted", [False, True])
def test_falcon_mamba_scan_input_norms_run_on_the_wrappers(example, workdir, monkeypatch, planted):
    """FalconMamba's mixer normalizes dt, B and C (weightless RMSNorms) before the scan; the wrapper runs them, and
    C2's fidelity check against the stock model passes. With the norms left out (the plant) it fails."""
    import json

    from tic.harness.kernels import mamba_modules

    ex = example("tiny-mamba")
    cfg = json.loads((ex / "config.json").read_text())
    cfg.update(architectures=["FalconMambaForCausalLM"], model_type="falcon_mamba", mixer_rms_eps=1e-6)
    (ex / "config.json").write_text(json.dumps(cfg))
    if planted:
        monkeypatch.setattr(mamba_modules, "SCAN_INPUT_NORMS", ("not_there",) * 3)
    hf._MODELS.clear()
    ctx = GateContext(load_config(ex / "tic-consistent.yaml"))
    res = run_gate(get("C2"), ctx)
    hf._MODELS.clear()
    if planted:
        assert res.verdict == "fail" and "fidelity" in res.reason, res.reason
    else:
        assert res.verdict == "pass", res.reason


@pytest.fixture
def jamba_ctx(example, workdir):
    yield _small_ctx(example, "tiny-jamba")
    hf._MODELS.clear()


def test_jamba_layers_pass_c2_to_c7(jamba_ctx):
    """Jamba's layers: input_layernorm, a Mamba-1 mixer under `mamba` (or attention under `self_attn`),
    pre_ff_layernorm, a `feed_forward` MLP or MoE whose `router` keeps its top-k weights unnormalised."""
    for gate in ("C2", "C3", "C4", "C5", "C6", "C7"):
        res = run_gate(get(gate), jamba_ctx)
        assert res.verdict == "pass", (gate, res.reason)
    model = jamba_ctx.rollout_engine().model
    assert model.model.layers[1].feed_forward._tic_routing == Routing(renormalize=False)  # read from its forward


def test_jamba_router_renormalised_the_qwen_way_parts_from_stock(jamba_ctx, monkeypatch):
    """The plant: the MoE wrapper renormalises Jamba's top-k weights (the default of routers that do); C2's
    fidelity check names the first module that parts from the stock model."""
    from tic.harness.kernels import coverage, modules

    for where in (coverage, modules):  # C0's reading, which the wrappers take, and the wrappers' own
        monkeypatch.setattr(where, "router_routing", lambda router, cfg=None, handed=None: Routing())
    res = run_gate(get("C2"), jamba_ctx)
    assert res.verdict == "fail" and "fidelity" in res.reason and "feed_forward" in res.reason, res.reason


def test_c4_fails_when_a_jamba_mixer_sums_its_decode_in_another_order(jamba_ctx):
    model = jamba_ctx.rollout_engine().model
    plant_matmul_decode1(model.model.layers[0].mamba)
    res = run_gate(get("C4"), jamba_ctx)
    assert res.verdict == "fail" and res.metrics["equal_fraction"] < 1, res.reason


def test_c0_refuses_decoder_layers_with_mamba_mixers_and_no_attention(example, workdir, tic):
    """transformers cannot build a Jamba model's causal mask from a cache without an attention layer: C0 refuses
    such a configuration with the reason rather than letting C3 end in an error; the example, which has an
    attention layer, passes C0."""
    import json

    ex = example("tiny-jamba")
    code, out, _ = tic("gate", "C0", "-c", str(ex / "tic-consistent.yaml"), "--json")
    assert code == 0 and json.loads(out)["results"][0]["verdict"] == "pass"
    cfg = json.loads((ex / "config.json").read_text())
    cfg.update(attn_layer_period=8, attn_layer_offset=4)  # no attention among the 4 layers
    (ex / "config.json").write_text(json.dumps(cfg))
    code, out, _ = tic("gate", "C0", "-c", str(ex / "tic-consistent.yaml"), "--json")
    rec = json.loads(out)["results"][0]
    assert (rec["verdict"], code) == ("fail", 1) and "no attention layer anywhere" in rec["reason"], rec["reason"]
