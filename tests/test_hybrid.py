"""Mamba-2 hybrids on tic's consistent CPU kernels: the mixer's decode replays prefill's chunked scan bit for bit,
C3-C7 pass on a Mamba-2 model and a NemotronH-style hybrid, and a planted single-step decode fails C4."""

from __future__ import annotations

import pytest
import torch

from tic.config.schema import load_config
from tic.gates import get
from tic.harness.engines import hf
from tic.harness.kernels.mamba import cpu_mamba_scan, mamba_scan_ref
from tic.harness.kernels.coverage import coverage_problems
from tic.harness.testing.mamba_plants import plant_single_step_decode
from tic.skill.context import GateContext
from tic.skill.runner import run_gate

MODELS = ("tiny-mamba2", "tiny-nemotron-h")


def _scan_inputs(n: int, H=4, P=3, G=2, N=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return r(n, H, P), r(n, H), r(n, G, N), r(n, G, N), r(H) * 0.5, r(H) * 0.5, r(H)


@pytest.mark.parametrize("chunk", [1, 3, 4, 7])
def test_scan_decode_replays_prefill_bit_for_bit(chunk):
    """Prefill n tokens at once, or a prefix then one token per call from the carried chunk state: the same bits."""
    n, (x, dt, B, C, A_log, dt_bias, D) = 11, _scan_inputs(11)
    H, P, N = x.shape[1], x.shape[2], B.shape[2]
    lim = dict(chunk_size=chunk, dt_min=0.0, dt_max=float("inf"))
    zero = lambda *s: torch.zeros(*s)  # noqa: E731
    full, _ = cpu_mamba_scan(x, dt, B, C, A_log, dt_bias, D, zero(H, P, N), zero(0, H, P), zero(0, H),
                             zero(0, B.shape[1], N), **lim)
    for prefix in (1, 5):
        y, S = cpu_mamba_scan(x[:prefix], dt[:prefix], B[:prefix], C[:prefix], A_log, dt_bias, D, zero(H, P, N),
                              zero(0, H, P), zero(0, H), zero(0, B.shape[1], N), **lim)
        ys = [y]
        for t in range(prefix, n):
            lo = t // chunk * chunk  # the current chunk's tokens before t
            y, S = cpu_mamba_scan(x[t:t + 1], dt[t:t + 1], B[t:t + 1], C[t:t + 1], A_log, dt_bias, D, S,
                                  x[lo:t], dt[lo:t], B[lo:t], **lim)
            ys.append(y)
        assert torch.equal(torch.cat(ys), full)
    ref, _ = mamba_scan_ref(x, dt, B, C, A_log, dt_bias, D, zero(H, P, N), zero(0, H, P), zero(0, H),
                            zero(0, B.shape[1], N), **lim)
    assert torch.allclose(full, ref, atol=1e-5, rtol=1e-5)  # the same recurrence, another rounding order


@pytest.fixture
def hybrid_ctx(example, workdir, request):
    hf._MODELS.clear()
    cfg = load_config(example(request.param) / "tic-consistent.yaml")
    cfg.prompts.count, cfg.sampling.max_tokens = 5, 10  # prompts of 4-24 tokens: several chunks of 4
    cfg.layouts.batch_sizes, cfg.layouts.probes = [3], 1
    cfg.locate.enabled = False
    yield GateContext(cfg)
    hf._MODELS.clear()


@pytest.mark.parametrize("hybrid_ctx", MODELS, indirect=True)
def test_hybrid_passes_c3_to_c7(hybrid_ctx):
    """C6's layouts: micro-batch 1, left padding, packing, shuffled order."""
    for gate in ("C3", "C4", "C5", "C6", "C7"):
        res = run_gate(get(gate), hybrid_ctx)
        assert res.verdict == "pass", (gate, res.reason)
    rollout = hybrid_ctx.rollout_engine().model
    assert not coverage_problems(rollout)


@pytest.mark.parametrize("hybrid_ctx", ["tiny-nemotron-h"], indirect=True)
def test_c4_fails_when_one_mixer_decodes_by_the_single_step_recurrence(hybrid_ctx):
    model = hybrid_ctx.rollout_engine().model
    plant_single_step_decode(model.model.layers[3].mixer)
    res = run_gate(get("C4"), hybrid_ctx)
    assert res.verdict == "fail" and res.metrics["equal_fraction"] < 1 and res.metrics["max"] > 0


def test_decode_carries_the_mixer_state_in_the_hf_cache(example):
    """Prefill then decode through transformers' own cache: the cache object carries each mixer's row state, and
    every decoded token's logits equal the whole sequence's prefill."""
    from transformers import DynamicCache

    from tic.harness.engines.hf import cache_kwargs

    ctx = GateContext(load_config(example("tiny-nemotron-h") / "tic-consistent.yaml"))
    model = hf.load_model(ctx.model.dir, "float32", kernels="consistent", shared=False)
    ids = torch.tensor([[5, 9, 33, 2, 71, 18, 4, 90, 61, 7, 12]])
    with torch.no_grad():
        whole = model(input_ids=ids, use_cache=False).logits
        cache = DynamicCache(config=model.config)
        steps = [model(input_ids=ids[:, :6], position_ids=torch.arange(6)[None], use_cache=True,
                       **cache_kwargs(model, cache)).logits]
        for t in range(6, ids.shape[1]):
            steps.append(model(input_ids=ids[:, t:t + 1], position_ids=torch.tensor([[t]]), use_cache=True,
                               **cache_kwargs(model, cache)).logits)
    assert torch.equal(torch.cat(steps, dim=1), whole)
    carried = cache._tic_mamba
    assert sorted(carried) == [0, 3] and carried[0][0].length == ids.shape[1]


def test_mixers_the_wrapper_does_not_implement_are_named(example):
    ctx = GateContext(load_config(example("tiny-mamba2") / "tic-consistent.yaml"))
    model = hf.load_model(ctx.model.dir, "float32", kernels="stock", shared=False)  # sdpa asked: eager
    model.backbone.layers[1].mixer.activation = "gelu"
    problems = coverage_problems(model)
    assert any("backbone.layers.1.mixer" in p and "conv activation gelu" in p for p in problems), problems


class _WholeWidthGatedNorm(torch.nn.Module):
    """Mamba-2's gated norm as transformers before 5.2x defined it: no groups, one statistic over the whole width."""

    def __init__(self, norm):
        super().__init__()
        self.weight, self.variance_epsilon = norm.weight, norm.variance_epsilon

    def forward(self, hidden_states, gate=None):
        h = hidden_states.float() * torch.nn.functional.silu(gate.float())
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(hidden_states.dtype)


def test_a_gated_norm_without_groups_is_covered_as_one_group_over_its_width(example, monkeypatch):
    """The wrapped mixer reproduces such a norm within the fidelity bound; run with n_groups groups it would not."""
    from tic.harness.kernels import mamba_modules
    from tic.harness.measure.fidelity import compare_forward, fidelity_inputs

    d = GateContext(load_config(example("tiny-mamba2") / "tic-consistent.yaml")).model.dir
    stock = hf.load_model(d, "float32", kernels="stock", shared=False)
    wrapped = hf.load_model(d, "float32", kernels="consistent", shared=False)
    for model in (stock, wrapped):
        for layer in model.backbone.layers:
            layer.mixer.norm = _WholeWidthGatedNorm(layer.mixer.norm)
    assert coverage_problems(wrapped) == []
    ids, mask = fidelity_inputs(stock.config.vocab_size, "cpu")
    whole = compare_forward(stock, wrapped, ids, mask)
    assert whole["first_parting"] is None, whole
    monkeypatch.setattr(mamba_modules, "norm_group_size", lambda norm: norm.weight.shape[-1] // stock.config.n_groups)
    assert compare_forward(stock, wrapped, ids, mask)["first_parting"] is not None


def test_locator_names_the_mixer_that_decodes_by_the_single_step_recurrence(tmp_path, monkeypatch):
    """Decode side A (the plant in layer 3's mixer) against score side B: the first divergent layer and module, and
    a repro of the mixer that shows the difference in a fresh process (exit 1)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
    from tic_locate_pair import engines

    from tic.harness.engines.base import Sampling
    from tic.harness.locate.hf_capture import HFCaptureRunner
    from tic.harness.locate import report
    from tic.harness.locate.search import Side, locate

    monkeypatch.chdir(tmp_path)
    a, b = engines(Path(__file__).resolve().parent.parent / "examples" / "tiny-nemotron-h" / "tic-consistent.yaml")
    plant_single_step_decode(a.model.model.layers[3].mixer)
    upto = 6
    samples = a.generate([[5, 17, 99, 3, 250, 31], [7, 8, 9], [100, 2, 77, 13, 14]],
                         Sampling(temperature=1.0, max_tokens=upto + 1, seed=0), [0, 1, 2])
    ra, rb = HFCaptureRunner(a), HFCaptureRunner(b)
    found = locate(Side("decode", ra, lambda spec: ra.decode(samples, 0, upto, spec)),
                   Side("score", rb, lambda spec: rb.score(samples, 0, spec)), tmp_path / "out", "plant", upto)
    res = report.write(found, tmp_path / "out")
    assert res["first_divergent_layer"] == "model.layers.3", res["status"]
    assert res["culprit_module"] == "model.layers.3.mixer", res["status"]
    assert res["repro"] and res["repro_check"]["reproduces"] and res["repro_check"]["exit_code"] == 1, res["status"]
    assert "DIFFERS model.layers.3.mixer" in res["repro_check"]["output"]


@pytest.mark.parametrize("name", MODELS)
def test_both_providers_cover_the_mamba_mixer_and_relu2(example, name):
    """kernels: vllm runs the mixer on vLLM's kernels (tests/test_mamba_vllm.py); relu2 on both."""
    ctx = GateContext(load_config(example(name) / "tic-consistent.yaml"))
    model = hf.load_model(ctx.model.dir, "float32", kernels="stock", shared=False)
    assert coverage_problems(model, "vllm") == coverage_problems(model, "consistent") == []


def test_nemotron_h_moe_blocks_are_named_as_not_covered():
    import json
    from pathlib import Path

    from transformers import AutoModelForCausalLM, NemotronHConfig

    cfg = json.loads((Path(__file__).resolve().parent.parent / "examples" / "tiny-nemotron-h" / "config.json")
                     .read_text())
    cfg.update(hybrid_override_pattern="ME*", num_hidden_layers=3, n_routed_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=16, moe_shared_expert_intermediate_size=16)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            NemotronHConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}))
    problems = coverage_problems(model)
    assert any("model.layers.1.mixer (NemotronHMoE)" in p for p in problems), problems
    assert not any("layers.0" in p or "layers.2" in p for p in problems), problems  # mixer and attention: covered


@pytest.mark.parametrize("name, rollout, why", [
    ("tiny-nemotron-h", "{engine: vllm}", "Mamba-2 mixer(s): vLLM 0.26 decodes"),
    ("tiny-mamba2", "{engine: vllm, patches: [mamba-ssd-fixed-config]}", "Mamba-2 mixer(s): vLLM 0.26 decodes"),
    ("tiny-mamba2", "{engine: vllm, patches: [mamba-decode-replay], options: {enforce_eager: false}}",
     "mamba-decode-replay has been measured eager and with full CUDA graphs of the decode steps"),
    ("tiny-mamba2", "{engine: vllm, patches: [mamba-decode-replay], options: {enforce_eager: false, "
     "compilation_config: {mode: 0}, cudagraph_mode: PIECEWISE}}", "measured eager and with full CUDA graphs"),
    ("tiny-mamba2", "{engine: vllm, patches: [mamba-decode-replay], options: {enforce_eager: false, "
     "compilation_config: {mode: 3, cudagraph_mode: FULL_DECODE_ONLY}}}", "measured eager and with full CUDA graphs"),
    ("tiny-mamba2", "{engine: vllm, patches: [mamba-decode-replay], options: {enforce_eager: false, "
     "compilation_config: {mode: 0}, cudagraph_mode: FULL_DECODE_ONLY}}", None),
    ("tiny-nemotron-h", "{engine: vllm, patches: [mamba-decode-replay], options: {enforce_eager: false, "
     "compilation_config: {mode: 0, cudagraph_mode: full_decode_only}}}", None),
    ("tiny-mamba2", "{engine: vllm, patches: [mamba-decode-replay]}", None),
    ("tiny-mamba", "{engine: vllm}", "Mamba-1 (selective scan) mixer(s)"),
    ("tiny-mamba", "{engine: vllm, patches: [mamba-decode-replay]}", "Mamba-1 (selective scan) mixer(s)"),
    ("tiny-jamba", "{engine: vllm}", "Mamba-1 (selective scan) mixer(s)"),
    ("tiny-mamba", "{engine: vllm, patches: [mamba1-prefill-steps]}", "set mamba_ssm_cache_dtype: float32"),
    ("tiny-mamba", "{engine: vllm, patches: [mamba1-prefill-steps], options: {mamba_ssm_cache_dtype: float32, "
     "enforce_eager: false}}", "mamba1-prefill-steps is held to the modes"),
    ("tiny-mamba", "{engine: vllm, patches: [mamba1-prefill-steps], options: {mamba_ssm_cache_dtype: float32}}",
     None),
    ("tiny-jamba", "{engine: vllm, patches: [mamba1-prefill-steps], options: {mamba_ssm_cache_dtype: float32, "
     "enforce_eager: false, compilation_config: {mode: 0, cudagraph_mode: FULL_DECODE_ONLY}}}", None),
    ("tiny-nemotron-h", "{engine: vllm, patches: [mamba-decode-replay], options: {enable_prefix_caching: true}}",
     "prefix caching of Mamba states"),
    ("tiny-jamba", "{engine: vllm, patches: [mamba1-prefill-steps], options: {mamba_ssm_cache_dtype: float32, "
     "enable_prefix_caching: true}}", "set enable_prefix_caching: false"),
    ("tiny-qwen3", "{engine: vllm, options: {enable_prefix_caching: true}}", None),
    ("tiny-qwen3", "{engine: vllm}", None)])
def test_c0_refuses_a_vllm_rollout_of_a_mamba_model_without_the_replay_patch_in_a_measured_mode(
        example, workdir, tic, name, rollout, why):
    import json

    ex = example(name)
    (ex / "r.yaml").write_text(f"model: {{path: ., generate: {{seed: 0}}}}\nrollout: {rollout}\n")
    code, out, _ = tic("gate", "C0", "-c", str(ex / "r.yaml"), "--json")
    rec = json.loads(out)["results"][0]
    if why:
        assert (rec["verdict"], code) == ("fail", 1) and why in rec["reason"], rec["reason"]
    else:
        assert (rec["verdict"], code) == ("pass", 0), rec["reason"]


@pytest.mark.parametrize("name, blocks", [("tiny-nemotron-h", 5)])
def test_hybrid_blocks_join_the_residual_in_the_next_norm(example, workdir, name, blocks):
    """As vLLM's hybrid layers: each block after the first normalises (previous mixer output, residual) in one
    add+norm, and so does the final norm; only the first block's norm sees a plain tensor. (On vLLM's kernels the
    fused add+norm and an add followed by a norm are different kernels.)"""
    hf._MODELS.clear()
    ctx = GateContext(load_config(example(name) / "tic-consistent.yaml"))
    model = ctx.rollout_engine().model
    provider, calls = model._tic_ops.provider, []
    for op in ("add_rms_norm", "rms_norm"):
        real = getattr(provider, op)
        setattr(provider, op, lambda *a, _real=real, _op=op, **k: calls.append(_op) or _real(*a, **k))
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3, 4, 5, 6, 7]]))
    assert calls.count("add_rms_norm") == blocks  # blocks 1.. and the final norm
    hf._MODELS.clear()
