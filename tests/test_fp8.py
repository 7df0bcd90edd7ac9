"""Block FP8: the deployment rule, checkpoints written by it, the CPU kernels `kernels: consistent` runs on them,
the straight-through backward, the quantized copies a weight sync rewrites in place, and C3-C5/C8 on a
generated block-FP8 MoE model (with a planted divergence that must fail C5)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tic.config.schema import load_config
from tic.core.errors import TicInputError
from tic.gates import get
from tic.harness.engines import hf
from tic.harness.kernels.autograd import OPS, Ops
from tic.harness.kernels.consistent_cpu import CPUProvider
from tic.harness.kernels.fp8 import FP8_OPS, QuantizedCopies
from tic.harness.kernels.fp8_cpu import block_fp8_matmul, fp8_linear, per_token_group_quant
from tic.harness.model.inventory import tensor_locations
from tic.harness.model.quantize import dequantize_weight_blocks, quantize_weight_blocks
from tic.skill.context import GateContext
from tic.skill.runner import run_gate

BLOCK = (16, 16)


def _weight(n=48, k=32, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


# ---- the deployment rule ---------------------------------------------------------------------------------------
def test_weight_rule_is_amax_over_448_per_tile():
    w = _weight(40, 32)  # 40 rows: the last tile row is partial
    q, s = quantize_weight_blocks(w, BLOCK)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and s.shape == (3, 2) and s.dtype == torch.float32
    for i in range(3):
        for j in range(2):
            tile = w[16 * i:16 * (i + 1), 16 * j:16 * (j + 1)]
            scale = tile.abs().max().clamp(min=1e-4) / 448.0
            assert s[i, j].item() == scale.item()
            assert torch.equal(q[16 * i:16 * (i + 1), 16 * j:16 * (j + 1)], (tile * (1.0 / scale)).to(torch.float8_e4m3fn))
    assert q.float().abs().max().item() == 448.0  # each tile's largest weight lands on e4m3's largest code
    back = dequantize_weight_blocks(q, s, BLOCK, torch.float32)
    assert ((back - w).abs() <= w.abs() * 2 ** -4 + 1e-12).all()  # within e4m3's half-ulp (3 mantissa bits)


def test_activation_groups_follow_vllms_eps_and_clamp():
    x = torch.zeros(2, 32)
    x[0, :16] = torch.linspace(-3, 5, 16)
    q, s = per_token_group_quant(x, 16)
    assert s[0, 0].item() == torch.tensor(5.0 / 448.0).item() and q[0, :16].float().max().item() == 448.0
    assert s[1, 1].item() == torch.tensor(1e-10 / 448.0).item() and q[1].float().abs().sum() == 0  # an all-zero group
    with pytest.raises(ValueError, match="multiple of the group"):
        per_token_group_quant(torch.ones(1, 24), 16)


def test_block_gemm_row_does_not_depend_on_its_batch():
    w = _weight()
    wq, ws = quantize_weight_blocks(w, BLOCK)
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(1))
    batch = fp8_linear(x, wq, ws, None, BLOCK)
    for i in (0, 3, 6):
        assert torch.equal(fp8_linear(x[i:i + 1], wq, ws, None, BLOCK), batch[i:i + 1])
    xq, xs = per_token_group_quant(x, 16)
    exact = (xq.double() * xs.double().repeat_interleave(16, 1)) @ dequantize_weight_blocks(wq, ws, BLOCK,
                                                                                            torch.float64).t()
    assert torch.allclose(batch.double(), exact, rtol=1e-5, atol=1e-6)  # the block-scaled product, float32 accumulated
    assert not torch.allclose(batch, x @ w.t(), rtol=1e-3, atol=1e-5)  # and not the unquantized GEMM


def test_block_gemm_accumulates_each_k_block_with_its_own_scales():
    """A planted wrong scale in one K block changes exactly the outputs that read it."""
    wq, ws = quantize_weight_blocks(_weight(32, 48), BLOCK)
    xq, xs = per_token_group_quant(torch.randn(3, 48, generator=torch.Generator().manual_seed(2)), 16)
    ref = block_fp8_matmul(xq, xs, wq, ws, BLOCK, torch.float32)
    bad = ws.clone()
    bad[1, 2] *= 2
    out = block_fp8_matmul(xq, xs, wq, bad, BLOCK, torch.float32)
    assert torch.equal(out[:, :16], ref[:, :16]) and not torch.equal(out[:, 16:], ref[:, 16:])


# ---- the wrappers: FP8 forward, straight-through backward against the master weights --------------------------
def test_fp8_linear_forward_is_the_kernel_and_backward_the_unquantized_linears():
    w = torch.nn.Parameter(_weight())
    quant = QuantizedCopies(BLOCK)
    quant.register("w", w)
    ops = Ops(CPUProvider(), table={**OPS, **FP8_OPS}, quant=quant)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(3), requires_grad=True)
    y = ops.linear(x, [w])
    wq, ws = quant.get(w)
    assert torch.equal(y, fp8_linear(x.detach(), wq, ws, None, BLOCK))
    g = torch.randn(5, 48, generator=torch.Generator().manual_seed(4))
    y.backward(g)
    assert torch.equal(x.grad, g @ w.detach()) and torch.equal(w.grad, g.t() @ x.detach())


def test_copies_are_kept_then_requantized_in_place_when_the_master_changes():
    w = torch.nn.Parameter(_weight())
    quant = QuantizedCopies(BLOCK)
    seeded_q, seeded_s = quantize_weight_blocks(w.detach() * 0.5, BLOCK)  # a checkpoint's copy: kept as given
    quant.register("w", w, seeded_q, seeded_s)
    q, s = quant.get(w)
    assert torch.equal(q.float(), seeded_q.float()) and torch.equal(s, seeded_s)
    ptrs = (q.data_ptr(), s.data_ptr())
    assert quant.refresh() == []
    with torch.no_grad():
        w.add_(0.01)  # an optimizer step
    assert quant.refresh() == ["w"] and quant.requantized == 1
    q2, s2 = quant.get(w)
    want_q, want_s = quantize_weight_blocks(w.detach(), BLOCK)
    assert (q2.data_ptr(), s2.data_ptr()) == ptrs  # same addresses
    assert torch.equal(q2.float(), want_q.float()) and torch.equal(s2, want_s)


# ---- checkpoints -------------------------------------------------------------------------------------------------
def test_generated_fp8_checkpoint_is_laid_out_as_qwen3_fp8_ships(example, workdir):
    cfg = load_config(_fp8_example(example))
    ctx = GateContext(cfg)
    d = ctx.model.dir
    q = json.loads((d / "config.json").read_text())["quantization_config"]
    gates = [f"model.layers.{i}.mlp.gate" for i in (1, 2, 3)]  # the MoE layers (layer 0 is dense here)
    assert q == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [16, 16],
                 "modules_to_not_convert": ["lm_head", *gates]}  # else vLLM builds the router as an FP8 layer
    t = tensor_locations(d)
    fp8 = {k for k, v in t.items() if v["dtype"] == "F8_E4M3"}
    assert fp8 and all(k.endswith("_proj.weight") for k in fp8)
    assert all(k[: -len(".weight")] + ".weight_scale_inv" in t for k in fp8)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in fp8  # per-expert names, as the checkpoint ships
    for k in ("lm_head.weight", "model.embed_tokens.weight", "model.layers.1.mlp.gate.weight", "model.norm.weight"):
        assert t[k]["dtype"] == "F32", k
    assert t["model.layers.0.self_attn.q_proj.weight_scale_inv"]["shape"] == [4, 4]


def test_c2s_reference_loads_an_fp8_checkpoint_dequantized(example, workdir):
    """C2's transformers reference reads codes * scales per block into plain linears (no FP8 layer: on CUDA those
    need the hub's `kernels` package)."""
    from tic.harness.model.cut_check import load_hf
    from tic.harness.model.quantize import dequantize_weight_blocks, read_block_fp8

    d = GateContext(load_config(_fp8_example(example))).model.dir
    model, problems = load_hf(d)
    assert model is not None, problems
    params = dict(model.named_parameters())
    name = "model.layers.0.self_attn.q_proj.weight"
    codes, scales = read_block_fp8(d)[name]
    assert params[name].dtype != torch.float8_e4m3fn
    assert torch.equal(params[name], dequantize_weight_blocks(codes, scales, (16, 16), params[name].dtype))


def test_a_size_that_is_not_whole_blocks_is_one_clear_error(tmp_path):
    from tic.harness.model.generate import generate_model

    (tmp_path / "src").mkdir()
    cfg = json.loads((Path(__file__).parents[1] / "examples/tiny-qwen3/config.json").read_text())
    (tmp_path / "src" / "config.json").write_text(json.dumps(dict(cfg, intermediate_size=120, num_hidden_layers=1)))
    with pytest.raises(TicInputError, match="not a whole number of 16x16 blocks"):
        generate_model(tmp_path / "src", 0, quantization=("fp8", (16, 16)))


def test_cut_of_an_fp8_checkpoint_keeps_codes_and_scales(example, workdir):
    from tic.harness.model.cut import cut_model

    full = GateContext(load_config(_fp8_example(example))).model.dir
    cut = workdir / "cut"
    cut_model(full, cut, layers="0,1,2,3")
    src, dst = tensor_locations(full), tensor_locations(cut)
    assert {k: v["dtype"] for k, v in dst.items()} == {k: v["dtype"] for k, v in src.items()}
    assert json.loads((cut / "config.json").read_text())["quantization_config"]["weight_block_size"] == [16, 16]


# ---- gates on a generated block-FP8 MoE model, kernels: consistent on both sides ---------------------------------
def _fp8_example(example):
    ex = example("tiny-qwen3-moe")
    text = (ex / "tic-consistent.yaml").read_text().replace(
        "generate: {seed: 0}", "generate: {seed: 0, quantization: fp8, weight_block_size: [16, 16]}")
    assert "quantization: fp8" in text
    (ex / "tic-fp8.yaml").write_text(text)
    return ex / "tic-fp8.yaml"


@pytest.fixture
def fp8_ctx(example, workdir):
    hf._MODELS.clear()
    cfg = load_config(_fp8_example(example))
    cfg.prompts.count, cfg.sampling.max_tokens = 4, 6
    cfg.layouts.batch_sizes, cfg.layouts.probes = [3], 1
    cfg.locate.enabled = False
    yield GateContext(cfg)
    hf._MODELS.clear()


@pytest.mark.parametrize("gate", ["C3", "C4", "C5"])
def test_fp8_model_passes_with_consistent_kernels(fp8_ctx, gate):
    assert fp8_ctx.rollout_engine().model._tic_ops.quant is not None  # the FP8 path, not the dequantized model
    res = run_gate(get(gate), fp8_ctx)
    assert res.verdict == "pass", res.reason


def test_c2_compares_the_wrapped_fp8_model_with_transformers_following_the_fp8_forward(fp8_ctx, monkeypatch):
    """C2's stock model for a block-FP8 checkpoint is the FP8 forward in value (activations quantized per token
    group, codes times scales): the wrapped FP8 model matches it. Left dequantized (the plant: what C2 compared
    before), the stock model computes another model and C2 fails at the first quantized projection."""
    from tic.harness.measure import fp8_reference

    res = run_gate(get("C2"), fp8_ctx)
    assert res.verdict == "pass", res.reason
    monkeypatch.setattr(fp8_reference, "install", lambda model, model_dir, inputs=None, rules=None: None)
    res = run_gate(get("C2"), fp8_ctx)
    assert res.verdict == "fail" and "self_attn.q_proj" in res.reason, res.reason


def test_c5_fails_when_training_holds_its_scales_in_bfloat16(fp8_ctx):
    """Planted: the train side's copy of one projection keeps the checkpoint's codes but its scales rounded to
    bfloat16 (a trainer that stores scales in the model dtype); C5 must see it."""
    fp8_ctx.rollout_engine()
    hf._MODELS.clear()
    model = fp8_ctx.train_engine().model
    quant = model._tic_ops.quant
    name = "model.layers.2.self_attn.o_proj.weight"
    codes, scales = quant.copies()[name]
    assert not torch.equal(scales.bfloat16().float(), scales)
    quant.register(name, model.get_parameter(name), codes, scales.bfloat16().float())
    res = run_gate(get("C5"), fp8_ctx)
    assert res.verdict == "fail" and res.metrics["first_mismatch"] is not None


def test_c8_requantizes_in_place_and_the_rollout_holds_the_trainers_copy(fp8_ctx):
    fp8_ctx.cfg.training.updates = 2
    res = run_gate(get("C8"), fp8_ctx)
    assert res.verdict == "pass", res.reason
    assert res.metrics["storage_moved"] == 0 and res.metrics["unequal_after_sync"] == 0
    refreshed = res.details["syncs"][0]["refreshed"]
    assert "model.layers.0.self_attn.q_proj.weight" in refreshed and any("experts.gate_up_proj" in r for r in refreshed)


def test_synced_rollout_copies_equal_the_trainers_bitwise(fp8_ctx):
    from tic.harness.measure.rl import PolicyGradientTrainer, rollout_and_recompute, sync_weights

    rollout, train = fp8_ctx.private_engine("rollout", "t"), fp8_ctx.private_engine("train", "t")
    trainer = PolicyGradientTrainer(train, 1e-3)
    samples, _, _ = rollout_and_recompute(rollout, train, fp8_ctx.prompts, fp8_ctx.sampling, 0)
    trainer.step(samples, fp8_ctx.sampling)
    train.model._tic_ops.quant.refresh()  # the trainer's copy of the new weights (its next forward would make it)
    before = rollout.weight_storage()
    assert sync_weights(trainer, rollout).ok and rollout.weight_storage() == before
    mine, theirs = rollout.model._tic_ops.quant.copies(), train.model._tic_ops.quant.copies()
    assert mine.keys() == theirs.keys()
    for name, (q, s) in theirs.items():
        assert torch.equal(mine[name][0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(mine[name][1], s), name
    assert train.model._tic_ops.quant.requantized > 0



# ---- C7: the STE gradients against plain transformers following the FP8 forward ----------------------------------
def _c7(ctx):
    for k in [k for k in hf._MODELS if k[-1]]:  # the trainable copies: C7 backward runs a fresh one
        del hf._MODELS[k]
    return ctx.train_engine().trainable_model()


def test_c7_passes_on_the_fp8_model_and_fails_on_a_planted_fp8_backward(fp8_ctx):
    from tic.harness.testing.backward_plants import planted_fault

    fp8_ctx.cfg.prompts.count, fp8_ctx.cfg.sampling.max_tokens = 3, 4
    _c7(fp8_ctx)
    res = run_gate(get("C7"), fp8_ctx)
    assert res.verdict == "pass", res.reason
    for op, fault in (("fp8_linear", lambda g: (-g[0], *g[1:])),  # the input gradient's sign flipped
                      ("fp8_moe_experts", lambda g: (*g[:3], torch.zeros_like(g[3]), g[4]))):  # gate_up's lost
        with planted_fault(_c7(fp8_ctx), op, grads=fault):
            res = run_gate(get("C7"), fp8_ctx)
        assert res.verdict == "fail", (op, res.reason)


def _bf16_fp8_ctx(example, prompts: int | None = None, tokens: int | None = None) -> GateContext:
    """The FP8 example in bfloat16 (activations a rounding apart from a float32 reference's); prompts and tokens:
    a smaller workload than the example's."""
    path = _fp8_example(example)
    path.write_text(path.read_text().replace("dtype: float32", "dtype: bfloat16"))
    hf._MODELS.clear()
    cfg = load_config(path)
    cfg.prompts.count = prompts or cfg.prompts.count
    cfg.sampling.max_tokens = tokens or cfg.sampling.max_tokens
    cfg.locate.enabled = False
    return GateContext(cfg)


def test_c7_reference_quantizes_the_activations_the_path_under_test_quantized(example, workdir, monkeypatch):
    """A bfloat16 model: the path under test's activations and the float32 reference's are a rounding apart, and
    a few percent of them fall on another e4m3 code, so the two forwards drift by the format's step. C7's reference
    quantizers take the activations the path under test quantized (as its routers take its experts) and C7
    passes; on their own inputs (the plant: what C7 did before) the same, correct backward fails."""
    from tic.harness.engines.hf import HFEngine

    ctx = _bf16_fp8_ctx(example, prompts=3, tokens=4)
    res = run_gate(get("C7"), ctx)
    assert res.verdict == "pass", res.reason
    routing = res.details["routing"]
    assert routing["fp8_quantizer_calls_on_the_path_under_tests_inputs"] > 0
    assert routing["fp8_quantizer_calls_on_their_own_inputs"] == 0
    monkeypatch.setattr(HFEngine, "quantizer_inputs", lambda self, sample: {})
    res = run_gate(get("C7"), ctx)
    assert res.verdict == "fail", res.reason
    hf._MODELS.clear()


def test_c2_stock_quantizers_take_the_wrapped_models_inputs(example, workdir, monkeypatch):
    """C2's fidelity on a bfloat16 FP8 model: the stock model's quantizers take the activations the wrapped model
    quantized, so a rounding-level difference does not fall on another e4m3 code; on their own inputs (the plant)
    the same, correct wrappers part from stock."""
    from tic.harness.measure import fp8_reference

    ctx = _bf16_fp8_ctx(example)
    res = run_gate(get("C2"), ctx)
    assert res.verdict == "pass", res.reason
    assert res.details["fidelity"]["fp8_quantizer_calls_on_the_wrapped_inputs"] > 0
    monkeypatch.setattr(fp8_reference.QuantizerInputs, "take_shaped", lambda self, name, shape, device: None)
    res = run_gate(get("C2"), ctx)
    assert res.verdict == "fail" and "fidelity" in res.reason, res.reason
    hf._MODELS.clear()


def test_bf16_masters_do_not_round_trip_to_the_checkpoints_scales():
    """Why the loaded copy is the checkpoint's own: codes x scales rounded to bfloat16 requantize to scales a
    rounding apart (float32 masters would round trip), so a training side that requantized them would not run
    the rollout's weights."""
    q, s = quantize_weight_blocks(torch.randn(64, 64, generator=torch.Generator().manual_seed(5)) * 0.02, BLOCK)
    _, s_bf16 = quantize_weight_blocks(dequantize_weight_blocks(q, s, BLOCK, torch.bfloat16), BLOCK)
    _, s_f32 = quantize_weight_blocks(dequantize_weight_blocks(q, s, BLOCK, torch.float32), BLOCK)
    assert not torch.equal(s_bf16, s) and torch.equal(s_f32, s)


def test_checkpoint_weights_for_an_fp8_rollout_are_codes_and_scales_as_the_checkpoint_holds_them(fp8_ctx):
    """What a vLLM rollout (checkpoint format) is sent: before any update the checkpoint's own tensors, bitwise;
    after one, the deployment rule applied to each expert's and projection's new master weights."""
    from tic.harness.measure.rl import PolicyGradientTrainer, rollout_and_recompute
    from tic.harness.model.quantize import read_block_fp8

    train = fp8_ctx.private_engine("train", "t")
    trainer = PolicyGradientTrainer(train, 1e-3)
    stored = read_block_fp8(fp8_ctx.model.dir)
    sent = trainer.checkpoint_weights()
    for name, (q, s) in stored.items():
        assert torch.equal(sent[name].view(torch.uint8), q.view(torch.uint8)), name
        assert torch.equal(sent[name[: -len(".weight")] + ".weight_scale_inv"], s), name
    assert sent["lm_head.weight"].dtype == torch.float32  # unquantized weights as they are
    samples, _, _ = rollout_and_recompute(train, train, fp8_ctx.prompts[:2], fp8_ctx.sampling, 0)
    trainer.step(samples, fp8_ctx.sampling)
    sent = trainer.checkpoint_weights()
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    master = train.model.get_parameter("model.layers.1.mlp.experts.gate_up_proj")[3, 32:]
    q, s = quantize_weight_blocks(master.detach(), BLOCK)
    assert torch.equal(sent[name].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(sent[name[: -len(".weight")] + ".weight_scale_inv"], s)
    assert not torch.equal(s, stored[name][1])


def test_checkpoint_scales_keep_their_block_grid_where_a_split_drops_size_one_dimensions(example, workdir,
                                                                                          monkeypatch):
    """Blocks of 32 on the tiny MoE give expert grids one block wide ([2, 1], [1, 2]). transformers 5.17's
    per-expert split squeezed every size-1 dimension of what it split (the plant below does the same): the scales
    sent to vLLM were then 1-D and its MoE loader failed (C8 on the GPU). They keep the checkpoint's grid."""
    import transformers.core_model_loading as tcl

    from tic.harness.measure.rl import PolicyGradientTrainer
    from tic.harness.model.quantize import read_block_fp8

    split = tcl.SplitModulelist.convert
    monkeypatch.setattr(tcl.SplitModulelist, "convert",
                        lambda self, *a, **kw: {k: v.squeeze() for k, v in split(self, *a, **kw).items()})
    hf._MODELS.clear()
    path = _fp8_example(example)
    path.write_text(path.read_text().replace("weight_block_size: [16, 16]", "weight_block_size: [32, 32]"))
    ctx = GateContext(load_config(path))
    sent = PolicyGradientTrainer(ctx.private_engine("train", "t"), 1e-3).checkpoint_weights()
    stored = read_block_fp8(ctx.model.dir)
    grids = {tuple(s.shape) for _, s in stored.values()}
    assert {(2, 1), (1, 2)} <= grids, grids
    for name, (_, s) in stored.items():
        got = sent[name[: -len(".weight")] + ".weight_scale_inv"]
        assert got.shape == s.shape and torch.equal(got, s), name
    hf._MODELS.clear()


def test_block_grid_refuses_scales_that_are_not_their_codes_grid():
    from tic.harness.measure.rl import block_grid

    s = torch.arange(6.0)
    assert block_grid("w", s.reshape(1, 6, 1), (64, 192), (64, 32)).shape == (1, 6)
    with pytest.raises(RuntimeError, match="block grid"):
        block_grid("w", s.reshape(2, 3), (64, 192), (64, 32))


def test_fp8_round_trip_rounds_to_e4m3_saturating_with_a_straight_through_gradient():
    from tic.harness.measure.fp8_reference import fp8_round_trip

    t = torch.tensor([0.1234, -3.3, 1000.0], requires_grad=True)
    r = fp8_round_trip(t)
    assert torch.equal(r.detach(), torch.tensor([0.125, -3.25, 448.0]))
    r.sum().backward()
    assert torch.equal(t.grad, torch.ones(3))


def test_fp8_attention_is_flash_attentions_fp8_forward_row_by_row():
    """Per query row, written out: e4m3 q/k/v, P = exp(s - max) * 256 rounded to e4m3, P @ v over the float32 sum
    of the unrounded P; GQA heads share their K/V head. Rounding only q/k/v (the earlier reference) is another value."""
    from tic.harness.measure.fp8_reference import fp8_attention, fp8_round_trip

    g = torch.Generator().manual_seed(0)
    B, H, Hk, T, D = 2, 4, 2, 5, 8
    q, k, v = (torch.randn(B, h, T, D, generator=g) for h in (H, Hk, Hk))
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None].expand(B, 1, T, T)
    out = fp8_attention(q, k, v, mask, 0.3, H // Hk)
    assert out.shape == (B, T, H, D)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                qr, kr, vr = (fp8_round_trip(x) for x in (q[b, h, t], k[b, h // 2, : t + 1], v[b, h // 2, : t + 1]))
                p = torch.exp(kr @ qr * 0.3 - (kr @ qr * 0.3).max())
                want = ((p * 256).to(torch.float8_e4m3fn).float() @ vr) / (p.sum() * 256)
                assert torch.allclose(out[b, t, h], want, rtol=1e-6, atol=1e-7)
    qkv_only = torch.softmax(fp8_round_trip(q) @ fp8_round_trip(k).repeat_interleave(2, 1).transpose(-1, -2) * 0.3
                             + mask, -1) @ fp8_round_trip(v).repeat_interleave(2, 1)
    assert not torch.allclose(out, qkv_only.transpose(1, 2), rtol=1e-3, atol=1e-4)


def test_fp8_kv_cache_reference_runs_fp8_attention_in_value_and_the_models_eager_attention_for_autograd(
        example, monkeypatch):
    """C2's stock model and C7's reference with an FP8 KV cache: every layer's attention output is, in value,
    fp8_attention of its q, k, v; its gradient is the model's own eager attention's on the unrounded inputs
    (straight through, as the training side's SDPA backward); the logits move, a little."""
    import sys

    from tic.harness.measure import fp8_reference

    d = GateContext(load_config(example("tiny-qwen3") / "tic.yaml")).model.dir
    plain = hf.load_model(d, "float32", kernels="stock", attn="eager", shared=False)
    model = hf.load_model(d, "float32", kernels="stock", attn="eager", shared=False)
    modeling = sys.modules[type(model.model.layers[0].self_attn).__module__]
    seen, own = [], modeling.eager_attention_forward

    def recording(module, q, k, v, *args, **kwargs):
        out = own(module, q, k, v, *args, **kwargs)
        seen.append((q, k, v, out[0]))
        return out

    monkeypatch.setattr(modeling, "eager_attention_forward", recording)
    fp8_reference.use_fp8_kv_cache(model)
    model.requires_grad_(True)
    ids = torch.tensor([[5, 9, 2, 7, 11, 3]])
    layer = model.model.layers[0].self_attn
    got = []
    layer.o_proj.register_forward_hook(lambda m, args, out: got.append(args[0]))
    logits = model(input_ids=ids).logits
    assert len(seen) == len(model.model.layers)
    q, k, v, graph = seen[0]
    mask = torch.full((6, 6), float("-inf")).triu(1)[None, None]
    want = fp8_reference.fp8_attention(q, k, v, mask, layer.scaling, q.shape[1] // k.shape[1])
    assert torch.allclose(got[0].detach(), want.reshape(got[0].shape), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(want, graph.detach(), rtol=1e-3, atol=1e-4)  # the FP8 forward is another value
    with torch.no_grad():
        ref = plain(input_ids=ids).logits
    assert not torch.equal(logits.detach(), ref) and torch.allclose(logits.detach(), ref, atol=0.05)
    # the gradient at the attention output reaches q/k/v through the eager graph, not through the rounding
    gq = torch.autograd.grad(logits.sum(), q, retain_graph=True)[0]
    assert gq.abs().sum() > 0


def test_c7_reference_experts_take_the_path_under_tests_silu_mul(example, workdir, monkeypatch):
    """An FP8 expert block quantizes twice: its input, then SiLU*mul of the first GEMM for the down projection.
    The path under test records those rows too (one per token and top-k slot), and the reference's down quantizer
    takes them; with them dropped from the record (the plant) its down quantizers run on their own inputs."""
    from tic.harness.engines.hf import HFEngine

    ctx = _bf16_fp8_ctx(example, prompts=2, tokens=3)
    real = HFEngine.quantizer_inputs
    recorded = []

    def spy(self, sample):
        got = real(self, sample)
        recorded.append(sorted(got))
        return got
    monkeypatch.setattr(HFEngine, "quantizer_inputs", spy)
    res = run_gate(get("C7"), ctx)
    assert res.verdict == "pass", res.reason
    assert any(k.endswith("experts.down_proj") for k in recorded[0]), recorded[0]
    assert res.details["routing"]["fp8_quantizer_calls_on_their_own_inputs"] == 0
    monkeypatch.setattr(HFEngine, "quantizer_inputs", lambda self, sample: {
        k: v for k, v in real(self, sample).items() if not k.endswith("experts.down_proj")})
    res = run_gate(get("C7"), ctx)
    assert res.details["routing"]["fp8_quantizer_calls_on_their_own_inputs"] > 0
    hf._MODELS.clear()


def test_fp8_kv_cache_attention_inputs_are_recorded_and_taken_by_the_reference(example, monkeypatch):
    """With an FP8 KV cache both sides round q, k and v to e4m3 before attention. The path under test records
    each attention's (q, k, v) (Ops.capture_inputs, nothing without an FP8 cache), and the reference's FP8
    attention rounds those, not its own: inputs a bf16 rounding apart land on other e4m3 codes and move its
    output by the format's step (the plant: what C2/C7 did before), taken they give the path's values exactly."""
    from tic.harness.kernels.autograd import ATTENTION_INPUTS
    from tic.harness.measure import fp8_reference

    cfg = load_config(example("tiny-qwen3") / "tic-consistent.yaml")
    hf._MODELS.clear()
    engine = GateContext(cfg).train_engine()
    ops = engine.model._tic_ops
    sample = type("S", (), {"ids": [5, 9, 2, 7, 11, 3, 8]})()
    assert engine.quantizer_inputs(sample) == {}  # no FP8 step: nothing recorded
    monkeypatch.setattr(ops.provider, "kv_cache_dtype", "fp8", raising=False)
    seen = engine.quantizer_inputs(sample)
    layers = engine.model.config.num_hidden_layers
    assert list(seen) == [ATTENTION_INPUTS] and len(seen[ATTENTION_INPUTS]) == layers
    q, k, v = seen[ATTENTION_INPUTS][0]
    assert q.shape[:3] == (1, engine.model.config.num_attention_heads, 7) and k.shape == v.shape

    d = GateContext(cfg).model.dir
    ref = hf.load_model(d, "float32", kernels="stock", attn="eager", shared=False)
    got = []
    ref.model.layers[0].self_attn.o_proj.register_forward_hook(lambda m, args, out: got.append(args[0].detach()))
    mask = torch.full((7, 7), float("-inf")).triu(1)[None, None]
    scaling = ref.model.layers[0].self_attn.scaling
    ids = torch.tensor([sample.ids])
    # recorded inputs apart from the reference's own (here by a bf16 rounding and 1 %), so that which ones the
    # reference rounds shows in its output
    path = [tuple(t.to(torch.bfloat16).float() * 1.01 for t in call) for call in seen[ATTENTION_INPUTS]]
    for taken in (True, False):
        inputs = fp8_reference.QuantizerInputs()
        inputs.current = {ATTENTION_INPUTS: list(path)} if taken else {}
        fp8_reference.use_fp8_kv_cache(ref, inputs)
        got.clear()
        with torch.no_grad():
            ref(input_ids=ids, use_cache=False)
        want = fp8_reference.fp8_attention(*path[0], mask, scaling, q.shape[1] // k.shape[1])
        same = torch.equal(got[0], want.reshape(got[0].shape))
        if taken:
            assert same and inputs.attention_taken == layers and inputs.attention_own == 0
            assert inputs.counts("path_under_tests") == {"fp8_kv_attention_calls_on_the_path_under_tests_inputs":
                                                         layers, "fp8_kv_attention_calls_on_their_own_inputs": 0}
        else:
            assert not same and inputs.attention_own == layers
    hf._MODELS.clear()


def _ue8m0_linear(x, wq, ws, bias, block):
    """A block-FP8 linear that rounds as vLLM's DeepGEMM path with UE8M0 scales: weight tiles requantized to
    power-of-two scales, activation group scales rounded up to a power of two."""
    from tic.harness.kernels.fp8_rule import Fp8Rule

    wq, ws = Fp8Rule(weights_ue8m0=True).tiles(wq, ws, block)
    xq, xs = per_token_group_quant(x.reshape(-1, x.shape[-1]), block[1], ue8m0=True)
    out = block_fp8_matmul(xq, xs, wq, ws, block, x.dtype)
    return (out if bias is None else out + bias).reshape(*x.shape[:-1], wq.shape[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_rule_is_read_from_the_operators_outputs(dtype):
    """Which scale rule a provider's FP8 linear and experts follow is read from their outputs on seeded operands:
    tic's CPU kernels round as the checkpoint says (amax / 448), a UE8M0 linear is recognised as one, and an
    operator that follows no candidate (here: its output scaled by 1 %) is not identified."""
    from tic.harness.kernels import fp8_cpu as cpu
    from tic.harness.kernels.fp8_rule import DEFAULT, Fp8Rule, detect_experts, detect_linear

    p, block = CPUProvider(), (16, 16)
    experts = lambda x, w, i, gu, gus, d, ds: p.fp8_moe_experts(x, w, i, gu, gus, d, ds, block)  # noqa: E731
    assert detect_linear(lambda x, c, s: cpu.fp8_linear(x, c, s, None, block), block, dtype, "cpu") == DEFAULT
    assert detect_experts(experts, block, dtype, "cpu") == DEFAULT
    assert detect_linear(lambda x, c, s: _ue8m0_linear(x, c, s, None, block), block, dtype, "cpu") == \
        Fp8Rule(weights_ue8m0=True, activations_ue8m0=True)
    assert detect_linear(lambda x, c, s: cpu.fp8_linear(x, c, s, None, block) * 1.01, block, dtype, "cpu") is None


def test_c2_stock_model_rounds_by_the_rule_the_wrapped_operators_follow(example, workdir, monkeypatch):
    """Where the deployment's FP8 kernels round scales to powers of two (vLLM's DeepGEMM path), C2's stock model
    does too, read from the wrapped model's operators (HFEngine.fp8_rules), and C2 passes; told nothing (the plant:
    the checkpoint's scales, what it assumed before), the same correct wrappers part from it."""
    from tic.harness.engines.hf import HFEngine
    from tic.harness.kernels import fp8_cpu as cpu

    monkeypatch.setattr(cpu, "fp8_linear", _ue8m0_linear)
    ctx = _bf16_fp8_ctx(example)
    res = run_gate(get("C2"), ctx)
    assert res.verdict == "pass", res.reason
    rules = json.loads((ctx.state.artifacts_dir("C2") / "check.json").read_text())["fidelity"]["fp8_rules"]
    assert all("UE8M0" in r for r in rules.values()), rules
    hf._MODELS.clear()
    monkeypatch.setattr(HFEngine, "fp8_rules", lambda self: {})
    res = run_gate(get("C2"), GateContext(ctx.cfg))
    assert res.verdict == "fail" and "fidelity" in res.reason, res.reason
    hf._MODELS.clear()


def _kv_fp8_ctx(example, prompts: int = 3, tokens: int = 4) -> GateContext:
    """The bfloat16 FP8 example with an FP8 KV cache on both sides (tic's CPU kernels round q, k, v and P as
    FlashAttention's FP8 forward does)."""
    ctx = _bf16_fp8_ctx(example, prompts=prompts, tokens=tokens)
    for side in (ctx.cfg.rollout, ctx.cfg.train):
        side.options["kv_cache_dtype"] = "fp8"
    hf._MODELS.clear()
    return GateContext(ctx.cfg)


def test_fp8_kv_cache_on_cpu_kernels_passes_and_c7_takes_the_paths_attention_inputs(example, workdir, monkeypatch):
    """With an FP8 KV cache on tic's CPU kernels, C3-C7 pass, and C7's reference rounds the q, k, v the path under
    test rounded (one call per layer and sequence). Rounding its own float32 ones instead (the plant: what it did
    before) the same, correct backward moves further from it: bf16 and float32 q, k, v a rounding apart fall on
    other e4m3 codes."""
    from tic.harness.measure import fp8_reference

    ctx = _kv_fp8_ctx(example)
    assert ctx.train_engine().model._tic_ops.rounds_kv_to_fp8
    for gate in ("C3", "C4", "C5", "C6"):
        res = run_gate(get(gate), ctx)
        assert res.verdict == "pass", (gate, res.reason)
    taken = run_gate(get("C7"), ctx)
    assert taken.verdict == "pass", taken.reason
    routing = taken.details["routing"]
    from tic.harness.kernels.fp8_rule import DEFAULT_KV

    assert routing["fp8_rules"]["kv_attention"] == DEFAULT_KV.describe(), routing["fp8_rules"]
    assert routing["fp8_kv_attention_calls_on_their_own_inputs"] == 0
    assert routing["fp8_kv_attention_calls_on_the_path_under_tests_inputs"] > 0
    monkeypatch.setattr(fp8_reference.QuantizerInputs, "take_attention", lambda self, q, k, v: (q, k, v))
    own = run_gate(get("C7"), ctx)
    assert own.metrics["max_rel_error"] > 1.3 * taken.metrics["max_rel_error"], (own.metrics, taken.metrics)
    hf._MODELS.clear()


@pytest.mark.parametrize("change, message", [
    ({"train": {"kernels": "stock"}}, "needs train.kernels vllm or consistent"),
    ({"rollout": {"kv": "auto"}}, "differs from rollout.options.kv_cache_dtype"),
    ({"train": {"kv": "fp8_e5m2"}}, "tic's kernels model auto and fp8"),
])
def test_fp8_kv_cache_settings_tic_cannot_model_are_refused(example, workdir, change, message):
    """An FP8 KV cache on stock HF kernels (which keep K/V in the model dtype), sides that disagree on it, or a
    format tic's kernels do not round to: one clear line, exit 2 (TicInputError), before any gate runs."""
    from tic.skill.context import check_kernels

    cfg = _kv_fp8_ctx(example).cfg
    for side, what in change.items():
        c = getattr(cfg, side)
        if "kernels" in what:
            c.kernels = what["kernels"]
        if "kv" in what:
            c.options["kv_cache_dtype"] = what["kv"]
    with pytest.raises(TicInputError, match=message):
        check_kernels(cfg)
    hf._MODELS.clear()


def test_kv_cache_attention_rule_is_read_from_the_operator():
    """How attention over an FP8 KV cache rounds is read from the operator: tic's CPU kernels round q, k, v and P
    as FlashAttention's FP8 forward does; a backend that dequantizes K/V and computes in float32 (q and P left
    as they are) is recognised as that; attention without any FP8 rounding is no candidate."""
    import torch.nn.functional as F

    from tic.harness.kernels.fp8_cpu import e4m3_round
    from tic.harness.kernels.fp8_rule import DEFAULT_KV, KvRule, detect_kv_attention

    def dequantizing(q, k, v, mask, scale):
        k, v = (e4m3_round(t).float().repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        out = F.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask, scale=scale)
        return out.transpose(1, 2).to(q.dtype)

    fp8, plain = CPUProvider("fp8"), CPUProvider()
    for dtype in (torch.bfloat16, torch.float32):
        assert detect_kv_attention(lambda *a: fp8.attention(*a), dtype, "cpu") == DEFAULT_KV
        assert detect_kv_attention(dequantizing, dtype, "cpu") == KvRule(query_rounded=False, probs_rounded=False)
        assert detect_kv_attention(lambda *a: plain.attention(*a), dtype, "cpu") is None


def test_c2_names_an_fp8_rule_it_could_not_identify(example, workdir, monkeypatch):
    """Wrappers whose FP8 linear follows no known rule (here: UE8M0 weights with a 1 % gain, a plant): the rule is
    not identified, the stock model rounds by tic's default, and C2's failure line says so."""
    from tic.harness.kernels import fp8_cpu as cpu

    monkeypatch.setattr(cpu, "fp8_linear", lambda x, wq, ws, b, block: _ue8m0_linear(x, wq, ws, b, block) * 1.01)
    res = run_gate(get("C2"), _bf16_fp8_ctx(example))
    assert res.verdict == "fail" and "rounding rule of linear" in res.reason and "not identified" in res.reason, \
        res.reason
    hf._MODELS.clear()
