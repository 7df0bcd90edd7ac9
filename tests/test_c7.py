"""C7 and the autograd wrappers: controls pass, planted wrong backwards fail, stale weights are refused."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from tic.gates import get
from tic.harness.engines import hf
from tic.harness.kernels import autograd as ag
from tic.harness.kernels.consistent_cpu import CPUProvider
from tic.harness.kernels.spec import RolloutKernels
from tic.harness.kernels.varlen import paged_layout, varlen_from_mask
from tic.harness.testing.backward_plants import planted_fault
from tic.core.errors import TicInputError
from tic.config.schema import load_config
from tic.skill.context import GateContext
from tic.skill.runner import run_gate

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _ctx(tmp, name):
    ex = tmp / name
    shutil.copytree(EXAMPLES / name, ex, ignore=shutil.ignore_patterns("weights", ".tic", ".tic-*"))
    cfg = load_config(ex / "tic-consistent.yaml")
    cfg.prompts.count, cfg.prompts.max_len, cfg.sampling.max_tokens = 3, 10, 6
    cfg.locate.enabled = False
    cfg.state_dir = tmp / ".tic"
    return GateContext(cfg)


def _example_model_dir(tmp, name):
    """An example's generated model directory (its weights written under a copy of the example)."""
    from tic.harness.model.generate import resolve_model_dir

    ex = tmp / name
    shutil.copytree(EXAMPLES / name, ex, ignore=shutil.ignore_patterns("weights", ".tic", ".tic-*"))
    return resolve_model_dir(load_config(next(ex.glob("tic*.yaml"))))


def _rolled_out(tmp_path_factory, name):
    """A context whose rollout the module's tests share (the model cache is cleared around it)."""
    hf._MODELS.clear()
    ctx = _ctx(tmp_path_factory.mktemp(name), name)
    ctx.rollout_samples()
    yield ctx
    hf._MODELS.clear()


@pytest.fixture(scope="module")
def dense_ctx(tmp_path_factory):
    """One rollout shared by the dense tests; each test gets a fresh trainable model."""
    yield from _rolled_out(tmp_path_factory, "tiny-qwen3")


def _fresh_train_model(ctx):
    """A fresh trainable copy of the train engine's model: the one C7's backward runs next (a plant goes there)."""
    for k in [k for k in hf._MODELS if k[-1]]:  # the trainable copies
        del hf._MODELS[k]
    return ctx.train_engine().trainable_model()


def run_c7(ctx):
    _fresh_train_model(ctx)
    return run_gate(get("C7"), ctx)


# ---- controls ---------------------------------------------------------------------------------------------
def test_c7_passes_on_the_consistent_kernels(dense_ctx):
    res = run_c7(dense_ctx)
    assert res.verdict == "pass", res.reason
    assert res.metrics["tensors"] == len(list(dense_ctx.train_engine().model.parameters()))
    assert res.metrics["min_cosine"] > 0.9999 and res.metrics["max_rel_error"] < 1e-4


def test_the_train_sides_backward_switches_reach_its_wrapped_model(example):
    """tic.yaml's train.backward is read into the config once and handed to the train engine's wrapped model; the
    rollout side keeps its own (here the defaults)."""
    from tic.config.schema import BackwardConfig

    cfg = load_config(example("tiny-qwen3") / "tic-consistent.yaml")
    cfg.train.backward = BackwardConfig(fuse=False, grouped_mm=False)
    hf._MODELS.clear()
    try:
        ctx = GateContext(cfg)
        assert ctx.train_engine().model._tic_ops.backward.options == BackwardConfig(fuse=False, grouped_mm=False)
        assert ctx.rollout_engine().model._tic_ops.backward.options == BackwardConfig()
    finally:
        hf._MODELS.clear()


@pytest.fixture(scope="module")
def moe_ctx(tmp_path_factory):
    yield from _rolled_out(tmp_path_factory, "tiny-qwen3-moe")


def test_c7_passes_on_the_moe_model_with_the_reference_routed_as_the_path_under_test(moe_ctx):
    res = run_gate(get("C7"), moe_ctx)
    assert res.verdict == "pass", res.reason
    routing = res.details["routing"]
    assert routing["pinned"] and routing["routed_tokens"] > 0 and routing["unpinned"] == []
    assert routing["moe_routers"] == sum(1 for n, _ in moe_ctx.train_engine().model.named_modules()
                                         if n.endswith(".mlp.gate"))


@pytest.mark.parametrize("op, fault", [
    ("moe_route", lambda g: (-g[0], *g[1:])),                  # router logits' gradient sign-flipped
    ("moe_experts", lambda g: (g[0], torch.zeros_like(g[1]), *g[2:])),  # routing weights get no gradient
    ("moe_experts", lambda g: (g[0], g[1], g[2], g[3] * 2, *g[4:])),  # experts' gate_up gradient doubled
])
def test_c7_fails_on_a_planted_wrong_moe_backward(moe_ctx, op, fault):
    with planted_fault(moe_ctx.train_engine().trainable_model(), op, grads=fault):
        res = run_gate(get("C7"), moe_ctx)
    assert res.verdict == "fail" and "outside the tolerance" in res.reason


def test_routing_pin_gives_the_pinned_experts_their_float32_weights_and_counts_flips():
    from torch import nn

    from tic.harness.measure.gradcheck import RoutingPin

    class Gate(nn.Module):  # transformers' top-k router interface: (logits, top-k weights, top-k ids)
        top_k, norm_topk_prob = 2, True

        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5], [0.1, 0.0]]))

        def forward(self, x):
            logits = x @ self.weight.T
            w, ids = torch.softmax(logits, -1).topk(2, -1)
            return logits, w / w.sum(-1, keepdim=True), ids

    model = nn.Module()
    model.mlp = nn.Module()
    model.mlp.gate = Gate()
    pin = RoutingPin(model)
    x = torch.tensor([[2.0, 0.0], [0.0, 2.0]])
    want = torch.tensor([[0, 3], [1, 2]])  # row 0: the router's own choice is {0, 2}
    with pin.pinned({"mlp": want}):
        logits, w, ids = model.mlp.gate(x)
    assert torch.equal(ids, want) and pin.flips == 1 and pin.tokens == 2
    probs = torch.softmax(logits, -1).gather(-1, want)
    assert torch.equal(w, probs / probs.sum(-1, keepdim=True))
    assert model.mlp.gate(x)[2].tolist() != want.tolist()  # unpinned again outside the context


# ---- planted wrong backwards ---------------------------------------------------------------------------------
def _negate_first(grads):
    return (-grads[0], *grads[1:])


@pytest.mark.parametrize("op, fault", [
    ("rms_norm", _negate_first),                                # sign flip in one surrogate
    ("add_rms_norm", lambda g: (g[0], torch.zeros_like(g[1]), *g[2:])),  # residual gradient dropped
    ("silu_and_mul", lambda g: (g[0] * 1.5,)),                 # a wrong scale
])
def test_c7_fails_on_a_planted_wrong_backward(dense_ctx, op, fault):
    with planted_fault(_fresh_train_model(dense_ctx), op, grads=fault):
        res = run_gate(get("C7"), dense_ctx)
    assert res.verdict == "fail" and "outside the tolerance" in res.reason


@pytest.fixture(scope="module")
def sharp_bf16_ctx(tmp_path_factory):
    """A bf16 Llama drawn wide (init 0.3, no q/k norm): attention sharp enough that its bf16 forward parts from the
    float32 one, so even plain bf16 autograd gives gradients below C7's low-precision defaults."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
    from tic_small_ladder import small_ladder_ctx, wide_llama_config

    with pytest.MonkeyPatch.context() as mp:
        hf._MODELS.clear()
        yield small_ladder_ctx(tmp_path_factory.mktemp("sharp"), mp, wide_llama_config(0.3, 2), "bfloat16")
    hf._MODELS.clear()


def test_c7_judges_a_bf16_model_by_the_stock_bf16_models_own_distance_where_that_is_wider(sharp_bf16_ctx):
    """Control: the wrapped bf16 gradients miss the 0.99 default on this model, as the stock bf16 model's own do;
    each tensor's bounds widen to 1.5x the stock model's distance (never narrow), and C7 passes. A tic.yaml that
    sets the thresholds gets them as written: nothing widens, and C7 fails."""
    res = run_c7(sharp_bf16_ctx)
    assert res.verdict == "pass", res.reason
    rows = res.details["tensors"]
    assert res.metrics["min_cosine"] < 0.99 and res.details["stock_yardstick"]["relaxed"] > 0
    assert all(r["min_cosine"] <= 0.99 and r["max_rel_error"] >= 0.1 for r in rows if "stock_cosine" in r)
    assert all(r["cosine"] >= r["min_cosine"] for r in rows if r["cosine"] < 0.99)
    g = sharp_bf16_ctx.cfg.gradients
    g.min_cosine, g.max_rel_error = 0.99, 0.1
    try:
        res = run_c7(sharp_bf16_ctx)
    finally:
        g.min_cosine = g.max_rel_error = None
    assert res.verdict == "fail" and "stock_yardstick" not in res.details, res.reason


@pytest.mark.parametrize("op, fault", [
    ("rms_norm", _negate_first),
    ("add_rms_norm", lambda g: (g[0], torch.zeros_like(g[1]), *g[2:])),
    ("silu_and_mul", lambda g: (g[0] * 1.5,)),
])
def test_c7_still_fails_a_planted_wrong_backward_where_the_stock_yardstick_widens(sharp_bf16_ctx, op, fault):
    with planted_fault(_fresh_train_model(sharp_bf16_ctx), op, grads=fault):
        res = run_gate(get("C7"), sharp_bf16_ctx)
    assert res.verdict == "fail" and "outside the tolerance" in res.reason


def test_c7_fails_when_weights_change_between_forward_and_backward(dense_ctx):
    def optimizer_step(weights):
        for w in weights:
            w.add_(1e-3)

    with planted_fault(_fresh_train_model(dense_ctx), "linear", before=optimizer_step):
        res = run_gate(get("C7"), dense_ctx)
    assert res.verdict == "fail" and "stale weight version" in res.reason


def test_c7_never_passes_stock_training_kernels(dense_ctx):
    dense_ctx.cfg.train.kernels = "stock"
    try:
        res = run_gate(get("C7"), dense_ctx)
    finally:
        dense_ctx.cfg.train.kernels = "consistent"
    assert res.verdict == "fail" and "C7 checks the surrogate backward" in res.reason


# ---- the wrappers one by one (CPU provider) ---------------------------------------------------------------
def _op_cases():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    w = torch.nn.Parameter(r(8))
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()[None].expand(1, 2, 1, 5, 5)[0].clone()
    mask[0, 0, :, :2] = False  # left padding in row 0
    mask[0, 0, :2, :] = False
    return [
        ("rms_norm", (r(3, 8), w), {"eps": 1e-6}),
        ("add_rms_norm", (r(3, 8), r(3, 8), w), {"eps": 1e-6}),
        ("silu_and_mul", (r(3, 8),), {}),
        ("rotary", (r(5, 2, 8), r(5, 1, 8), torch.tensor([0, 1, 2, 0, 1]), r(6, 8)), {}),
        ("attention", (r(2, 4, 5, 8), r(2, 2, 5, 8), r(2, 2, 5, 8), mask), {"scale": 0.3}),
        ("moe_experts", (r(4, 8), r(4, 2).abs(), torch.tensor([[0, 2], [1, 2], [2, 0], [1, 0]]),
                         torch.nn.Parameter(r(3, 12, 8)), torch.nn.Parameter(r(3, 8, 6))), {}),
        ("log_softmax", (r(3, 11),), {}),
    ]


@pytest.mark.parametrize("case", _op_cases(), ids=lambda c: c[0])
def test_wrapper_forward_is_the_kernel_and_backward_the_reference(case):
    name, tensors, kw = case
    prov = CPUProvider()
    op = ag.OPS[name]
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]
    out = ag.KernelFunction.apply(op, ag.Ops(prov), kw, *leaves)
    outs = out if isinstance(out, tuple) else (out,)
    with torch.no_grad():
        direct = op.kernel(prov, *tensors, **kw)
    for a, b in zip(outs, direct if isinstance(direct, tuple) else (direct,)):
        assert torch.equal(a, b)  # forward value = the kernel's, bit for bit
    seeds = [torch.randn_like(o) for o in outs if o.is_floating_point()]
    torch.autograd.backward([o for o in outs if o.is_floating_point()], seeds)
    refs_in = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]
    ref = op.reference(*refs_in, **kw)
    torch.autograd.backward(list(ref) if isinstance(ref, tuple) else [ref], seeds)
    for a, b in zip(leaves, refs_in):
        if a.is_floating_point():
            assert torch.allclose(a.grad, b.grad, rtol=1e-10, atol=1e-12)


def test_linear_backward_matches_autograd_and_splits_fused_weights():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    ws = [torch.nn.Parameter(torch.randn(n, 5, generator=g, dtype=torch.float64)) for n in (4, 2)]
    bs = [torch.nn.Parameter(torch.randn(n, generator=g, dtype=torch.float64)) for n in (4, 2)]
    ops = ag.Ops(CPUProvider())
    out = ops.linear(x, ws, bs)
    seed = torch.randn(out.shape, generator=g, dtype=torch.float64)
    out.backward(seed)
    x2 = x.detach().clone().requires_grad_()
    ws2 = [w.detach().clone().requires_grad_() for w in ws]
    bs2 = [b.detach().clone().requires_grad_() for b in bs]
    torch.nn.functional.linear(x2, torch.cat(ws2), torch.cat(bs2)).backward(seed)
    for a, b in zip([x, *ws, *bs], [x2, *ws2, *bs2]):
        assert torch.allclose(a.grad, b.grad, rtol=1e-12)


@pytest.mark.parametrize("change", ["in_place", "storage"])
def test_backward_refuses_weights_changed_since_forward(change):
    w = torch.nn.Parameter(torch.randn(4, 3))
    out = ag.Ops(CPUProvider()).linear(torch.randn(2, 3, requires_grad=True), [w])
    if change == "in_place":
        with torch.no_grad():
            w.mul_(0.5)  # what an optimizer step does
    else:
        w.data = torch.randn(4, 3)  # a weight sync that swaps the tensor
    with pytest.raises(ag.StaleWeightError, match="changed since its forward"):
        out.sum().backward()


def test_a_plant_names_a_known_operator_of_a_wrapped_model():
    wrapped = torch.nn.Module()
    wrapped._tic_ops = ag.Ops(CPUProvider())
    with pytest.raises(KeyError):
        with planted_fault(wrapped, "no_such_op", grads=lambda g: g):
            pass
    with pytest.raises(ValueError, match="does not run tic's kernel wrappers"):
        with planted_fault(torch.nn.Linear(2, 2), "linear", grads=lambda g: g):
            pass


# ---- padded / packed batches to the varlen layout ------------------------------------------------------------
def test_varlen_from_padded_and_packed_masks():
    ar = torch.arange(6)
    causal = ar[None, :] <= ar[:, None]
    left = causal & (ar[None, :] >= 2) & (ar[:, None] >= 2)   # 2 padding tokens on the left
    right = causal & (ar[None, :] < 4)    # 2 padding tokens on the right (HF lets them see the valid keys)
    seg = torch.tensor([0, 0, 0, 1, 1, 1])
    packed = causal & (seg[None, :] == seg[:, None])          # two sequences of 3
    mask = torch.stack([left, right, packed])[:, None]
    v = varlen_from_mask(mask, 3, 6, "cpu")
    assert v.index.tolist() == [2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 14, 15, 16, 17]
    assert v.cu_seqlens.tolist() == [0, 4, 8, 11, 14] and v.max_seqlen == 4


def test_varlen_with_an_all_padding_row_and_no_tokens_at_all():
    ar = torch.arange(5)
    causal = ar[None, :] <= ar[:, None]
    seg = torch.tensor([0, 0, 1, 1, 1])
    mask = torch.stack([torch.zeros(5, 5, dtype=torch.bool), causal & (seg[None, :] == seg[:, None])])[:, None]
    v = varlen_from_mask(mask, 2, 5, "cpu")
    assert v.index.tolist() == [5, 6, 7, 8, 9] and v.cu_seqlens.tolist() == [0, 2, 5] and v.max_seqlen == 3
    p = paged_layout(v.cu_seqlens, 2)
    assert p.num_blocks == 3 and p.block_table.tolist() == [[0, 0], [1, 2]] and p.slots.tolist() == [0, 1, 2, 3, 4]
    empty = varlen_from_mask(torch.zeros(1, 1, 4, 4, dtype=torch.bool), 1, 4, "cpu")
    assert empty.index.numel() == 0 and empty.cu_seqlens.tolist() == [0] and empty.max_seqlen == 0
    assert paged_layout(empty.cu_seqlens, 16).num_blocks == 1


@pytest.mark.parametrize("lens, bs", [([5, 16, 1], 4), ([3, 40], 16), ([1], 16), ([16, 16], 16)])
def test_paged_layout_puts_every_token_in_its_own_sequence_pages(lens, bs):
    """Packed K/V written through the slots and read back through the block table give each sequence's keys
    in order (what FlashAttention reads with seqused_k), and no slot is shared."""
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    p = paged_layout(cu, bs)
    n = int(cu[-1])
    keys = torch.arange(1, n + 1, dtype=torch.float32)
    cache = torch.zeros(p.num_blocks * bs)
    cache[p.slots] = keys
    assert p.slots.unique().numel() == n and p.seq_lens.tolist() == lens
    for s, length in enumerate(lens):
        read = torch.cat([cache[b * bs:(b + 1) * bs] for b in p.block_table[s].tolist()])[:length]
        assert torch.equal(read, keys[int(cu[s]):int(cu[s + 1])])


def test_varlen_takes_a_sliding_window_mask_only_with_its_window():
    """A window-3 mask over a packed row of two sequences (4 and 3 tokens, one padding token): the layout of the
    full mask, given window 3; refused without the window or with another."""
    ar = torch.arange(8)
    seg = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2])
    causal = (ar[None, :] <= ar[:, None]) & (seg[None, :] == seg[:, None]) & (seg[:, None] < 2)
    window = causal & (ar[:, None] - ar[None, :] < 3)
    v = varlen_from_mask(window[None, None], 1, 8, "cpu", window=3)
    full = varlen_from_mask(causal[None, None], 1, 8, "cpu")
    assert v.index.tolist() == full.index.tolist() == list(range(7))
    assert v.cu_seqlens.tolist() == full.cu_seqlens.tolist() == [0, 4, 7] and v.max_seqlen == 4
    for w in (None, 2, 4):
        with pytest.raises(TicInputError, match="not block-causal"):
            varlen_from_mask(window[None, None], 1, 8, "cpu", window=w)


# ---- kernels: vllm on a machine without it ----------------------------------------------------------------
@pytest.mark.parametrize("side, why", [
    ("train: {engine: hf, kernels: vllm, device: cuda}", "kernels: vllm needs"),
    ("train: {engine: hf, kernels: vllm}", "set device: cuda"),
    ("rollout: {engine: hf, kernels: vllm, device: cuda}", "prefill-style training forwards only"),
])
def test_vllm_kernels_are_refused_where_they_cannot_run(example, workdir, tic, side, why):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    ex = example("tiny-qwen3")
    cfg = ex / "vllm.yaml"
    cfg.write_text("model: {path: ., generate: {seed: 0}}\n" + side + "\n")
    code, out, err = tic("gate", "C5", "-c", str(cfg))
    assert code == 2 and why in err and len(err.strip().splitlines()) == 1
    assert not (workdir / ".tic").exists()


def test_c7_gradients_artifact_lists_every_tensor(dense_ctx):
    res = run_c7(dense_ctx)
    data = json.loads((dense_ctx.state.artifacts_dir("C7") / "gradients.json").read_text())
    assert len(data["tensors"]) == res.metrics["tensors"] and data["min_cosine"] == 0.999


def _cpu_vllm_provider(monkeypatch, rollout: RolloutKernels = RolloutKernels()):
    """A vLLM provider whose vLLM kernels are not loaded (CPU): its plumbing runs, each kernel a test stands in."""
    from tic.harness.kernels.vllm_provider import VLLMProvider

    monkeypatch.setattr(VLLMProvider, "_load_vllm", lambda self: None)
    return VLLMProvider(rollout)


@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("batch", ["mixed", "right-padded", "right-padded-empty-row", "one-row"])
def test_vllm_provider_attention_layout_with_a_stand_in_kernel(monkeypatch, batch, block):
    """The vLLM provider's padded/packed -> varlen + paged K/V -> padded plumbing, checked on CPU: a stand-in for
    vLLM's flash_attn_varlen_func (causal attention per sequence over its pages) must give the row-wise CPU kernel's
    result on every valid token of a left-padded, a right-padded and a packed row; a batch of right-padded rows
    only is its own paged cache (no scatter), with the same result. The pages hold the page size the provider was
    built with."""
    from tic.harness.kernels.vllm_provider import VLLMProvider

    def varlen(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k, softmax_scale, causal, block_table,
               fa_version):
        """Paged like vLLM's KV cache: k/v [blocks, page, heads, D], each sequence's keys through its block table."""
        assert causal and cu_seqlens_q.dtype == torch.int32 and block_table.dtype == torch.int32
        assert k.dim() == 4 and k.shape[1] == block
        cu = cu_seqlens_q.tolist()
        outs = []
        for s, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
            n = int(seqused_k[s])
            assert n == b - a
            ks, vs = (torch.cat([c[blk] for blk in block_table[s].tolist()])[:n] for c in (k, v))
            outs.append(ag.attention_ref(q[a:b].transpose(0, 1)[None], ks.transpose(0, 1)[None],
                                         vs.transpose(0, 1)[None], None, softmax_scale)[0])
        return torch.cat(outs).to(q.dtype)

    monkeypatch.setattr(VLLMProvider, "_find_varlen_attention", staticmethod(lambda: varlen))
    prov = _cpu_vllm_provider(monkeypatch, RolloutKernels(block))
    prov.fa_version = 3
    ar = torch.arange(6)
    causal = ar[None, :] <= ar[:, None]
    seg = torch.tensor([0, 0, 0, 1, 1, 1])
    right = lambda n: causal & (ar[None, :] < n)  # noqa: E731
    mask = {"mixed": [causal & (ar[None, :] >= 2) & (ar[:, None] >= 2), right(4), causal & (seg[None, :] == seg[:, None])],
            "right-padded": [right(4), right(6), right(1)],
            "right-padded-empty-row": [right(3), torch.zeros(6, 6, dtype=torch.bool), right(5)],
            "one-row": [right(6)]}[batch]
    mask = torch.stack(mask)[:, None]
    B = mask.shape[0]
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, h, 6, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    got = prov.attention(q, k, v, mask, 0.35)
    want = CPUProvider().attention(q, k, v, mask, 0.35)
    valid = mask[:, 0].diagonal(dim1=1, dim2=2)
    assert torch.allclose(got[valid], want[valid], rtol=1e-5, atol=1e-6) and (got[~valid] == 0).all()
    assert bool(prov._layout(mask, B, 6, "cpu", block)[1].row_pages) == (batch != "mixed")


def test_a_training_side_on_vllm_kernels_is_built_with_the_rollouts_page_size(example, monkeypatch):
    """The KV page size and the logprob rule the configured vLLM rollout resolved are handed to the training
    provider when the train engine is built (the rollout engine first): nothing goes through the environment, so
    it cannot depend on which engine this process built last."""
    import os
    from types import SimpleNamespace

    _cpu_vllm_provider(monkeypatch)
    monkeypatch.setattr(hf, "require_vllm", lambda device: None)  # the model stays on CPU
    ex = example("tiny-qwen3")
    ctx = GateContext(load_config(ex / "tic-consistent.yaml"))  # built on CPU kernels, then switched to vLLM's
    cfg = ctx.cfg
    cfg.rollout.engine, cfg.train.kernels = "vllm", "vllm"
    asked = []
    rollout = SimpleNamespace(rollout_kernels=RolloutKernels(32, "v2_sampler"))
    monkeypatch.setattr(ctx, "rollout_engine", lambda: asked.append("rollout") or rollout)
    hf._MODELS.clear()
    try:
        prov = ctx.private_engine("train", "C8").model._tic_provider
        assert asked == ["rollout"] and (prov.kv_block_size, prov.logprob_rule) == (32, "v2_sampler")
        # a dump: what its options say of the vLLM that wrote it, else vLLM's defaults
        monkeypatch.setattr(ctx, "rollout_engine", GateContext.rollout_engine.__get__(ctx))
        (ex / "rollout.jsonl").write_text("")
        cfg.rollout.dump, cfg.rollout.engine = Path("rollout.jsonl"), "dump"
        prov = ctx.private_engine("train", "C8").model._tic_provider
        assert (prov.kv_block_size, prov.logprob_rule) == (16, "log_softmax")
        ctx._engines.clear()
        cfg.rollout.options = {"kv_block_size": 32, "model_runner": "v2"}
        prov = ctx.private_engine("train", "C8").model._tic_provider
        assert (prov.kv_block_size, prov.logprob_rule) == (32, "v2_sampler")
    finally:
        hf._MODELS.clear()
    assert asked == ["rollout"] and "TIC_VLLM_BLOCK_SIZE" not in os.environ



@pytest.mark.parametrize("options, why", [
    ("{block_size: 16}", "unknown option 'block_size'"),
    ("{kv_block_size: 0}", "kv_block_size 0"),
    ("{model_runner: v3}", "model_runner 'v3'"),
])
def test_a_dumps_options_are_checked_before_anything_is_written(example, workdir, tic, options, why):
    """A rollout dump says what the vLLM that wrote it ran (its page size and model runner) in rollout.options;
    anything else, or a value vLLM has not, is one line and exit 2, before .tic/ exists."""
    import yaml

    ex = example("tiny-qwen3")
    (ex / "rollout.jsonl").write_text("")
    data = yaml.safe_load((ex / "tic-consistent.yaml").read_text())
    data["rollout"] = {"engine": "dump", "dump": "rollout.jsonl", "options": yaml.safe_load(options)}
    data["train"]["kernels"] = "vllm"
    cfg = ex / "tic-dump.yaml"
    cfg.write_text(yaml.safe_dump(data))
    code, out, err = tic("gate", "C5", "-c", str(cfg))
    assert code == 2 and why in err and len(err.strip().splitlines()) == 1, err
    assert not any(p.name.startswith(".tic") for p in [*workdir.iterdir(), *ex.iterdir()])


def test_a_refused_training_side_on_vllm_kernels_starts_no_rollout_engine(example, monkeypatch):
    """The rollout's page size is asked for only after the train side's own checks pass."""
    ctx = GateContext(load_config(example("tiny-qwen3") / "tic-consistent.yaml"))
    ctx.cfg.rollout.engine, ctx.cfg.train.kernels = "vllm", "vllm"
    ctx.cfg.train.options = {"no_such_option": 1}
    asked = []
    monkeypatch.setattr(ctx, "rollout_engine", lambda: asked.append("rollout"))
    with pytest.raises(TicInputError, match="unknown hf option"):
        ctx.train_engine()
    assert asked == []

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "hidden_act": "silu", "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
         "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64},
         "attention_bias": True, "tie_word_embeddings": True, "initializer_range": 0.02, "dtype": "float32"}


def test_llama_through_the_wrappers_passes_c5_c6_c7(tmp_path):
    """A family no example names (Llama: no QK norm, q/k/v bias, llama3 rope scaling, tied embeddings)."""
    d = tmp_path / "tiny-llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA))
    (d / "tic.yaml").write_text(
        "model: {path: ., dtype: float32, generate: {seed: 0}}\n"
        "rollout: {engine: hf, kernels: consistent, batch_size: 4}\n"
        "train: {engine: hf, kernels: consistent, micro_batch_size: 2}\n"
        "prompts: {count: 3, min_len: 3, max_len: 8}\nsampling: {max_tokens: 5}\nlocate: {enabled: false}\n")
    hf._MODELS.clear()
    cfg = load_config(d / "tic.yaml")
    cfg.state_dir = tmp_path / ".tic"
    ctx = GateContext(cfg)
    try:
        for gate in ("C5", "C6", "C7"):
            res = run_gate(get(gate), ctx)
            assert res.verdict == "pass", (gate, res.reason)
        with planted_fault(_fresh_train_model(ctx), "attention", grads=_negate_first):
            assert run_gate(get("C7"), ctx).verdict == "fail"
    finally:
        hf._MODELS.clear()


def test_vllm_provider_gemm_follows_batch_invariant_mode(monkeypatch):
    """In batch-invariant mode vLLM's linear layers call its Triton linear_batch_invariant directly (not aten);
    the provider must run the same function, and the unquantized GEMM dispatch otherwise."""
    import sys
    import types

    from tic.harness.kernels.vllm_provider import VLLMProvider

    calls = []
    bi = types.ModuleType("vllm.model_executor.layers.batch_invariant")
    bi.linear_batch_invariant = lambda x, w, b=None: calls.append("bi") or x @ w.t()
    utils = types.ModuleType("vllm.model_executor.layers.utils")
    utils.dispatch_unquantized_gemm = lambda: (lambda layer, x, w, b: calls.append("dispatch") or x @ w.t())
    for name in ("vllm", "vllm.model_executor", "vllm.model_executor.layers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, bi.__name__, bi)
    monkeypatch.setitem(sys.modules, utils.__name__, utils)
    x, w = torch.ones(2, 3), torch.ones(4, 3)
    VLLMProvider._find_gemm(True)(x, w, None)
    VLLMProvider._find_gemm(False)(x, w, None)
    assert calls == ["bi", "dispatch"]


def test_vllm_provider_reuses_a_mask_layout_only_for_that_unchanged_mask(monkeypatch):
    """Every layer of one forward passes the same mask object: its varlen/paged layout is built once. A mask
    changed in place, another mask (even with equal contents or shape) or another page size builds afresh."""
    from tic.harness.kernels import vllm_provider as vp

    built = []
    real = vp.varlen_from_mask
    monkeypatch.setattr(vp, "varlen_from_mask", lambda m, *a: built.append(m) or real(m, *a))
    prov = _cpu_vllm_provider(monkeypatch)
    ar = torch.arange(6)
    causal = ar[None, :] <= ar[:, None]
    mask = torch.stack([causal, causal & (ar[None, :] < 4)])[:, None].clone()
    first = prov._layout(mask, 2, 6, "cpu", 16)
    assert prov._layout(mask, 2, 6, "cpu", 16) is first and len(built) == 1
    mask[1, 0] = causal  # in place: the right padding is gone
    vl, _ = prov._layout(mask, 2, 6, "cpu", 16)
    assert len(built) == 2 and vl.cu_seqlens.tolist() == [0, 6, 12]
    other = mask.clone()
    prov._layout(other, 2, 6, "cpu", 16)
    prov._layout(other, 2, 6, "cpu", 4)
    assert len(built) == 4
    assert prov._layout(None, 2, 6, "cpu", 4) is prov._layout(None, 2, 6, "cpu", 4)
    assert prov._layout(None, 1, 6, "cpu", 4)[0].cu_seqlens.tolist() == [0, 6] and len(built) == 6
    with torch.inference_mode():  # C5's recompute scores under inference mode: such masks carry no version
        inf = mask.clone()
        first = prov._layout(inf, 2, 6, "cpu", 16)
        inf[1, 0] = causal & (ar[None, :] < 2)
        vl, _ = prov._layout(inf, 2, 6, "cpu", 16)
    assert len(built) == 8 and vl.cu_seqlens.tolist() == [0, 6, 8] and first[0].cu_seqlens.tolist() == [0, 6, 12]


def test_the_kernels_check_looks_vllm_up_without_importing_it(example, tmp_path, monkeypatch):
    """vLLM reads its mode (VLLM_BATCH_INVARIANT) once, at import, and the rollout engine sets it: the check made
    when the gate context is built must not import vLLM first (on the H200 a batch-invariant rollout with
    `kernels: vllm` training was refused because the check had imported vLLM in default mode)."""
    import sys

    from tic.config.schema import load_config
    from tic.skill.context import GateContext

    fake = tmp_path / "site" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise RuntimeError('vllm imported by the check')\n")
    monkeypatch.syspath_prepend(str(fake.parent))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ex = example("tiny-qwen3")
    cfg = ex / "vllm.yaml"
    cfg.write_text("model: {path: ., generate: {seed: 0}}\ntrain: {engine: hf, kernels: vllm, device: cuda}\n")
    GateContext(load_config(cfg))
    assert "vllm" not in sys.modules
    (fake.parent / "vllm").rename(fake.parent / "elsewhere")
    with pytest.raises(TicInputError, match="needs vLLM installed"):
        GateContext(load_config(cfg))


@pytest.mark.parametrize("kv, rounded", [("fp8", True), ("auto", False)])
def test_c7s_reference_takes_the_training_sides_kv_cache_dtype(dense_ctx, monkeypatch, kv, rounded):
    """With train.options.kv_cache_dtype fp8 (a train side on vLLM's kernels) the reference's attention reads
    FP8-rounded q, k, v, as both engines' FP8 KV cache does; without it, it does not. (The measurement is run on
    the CPU kernels with the option set on the train side alone, behind the config check, which refuses that.)"""
    from tic.gates import c7
    from tic.harness.measure import fp8_reference

    used = []
    monkeypatch.setattr(fp8_reference, "use_fp8_kv_cache",
                        lambda model, inputs=None, rule=None: used.append(type(model).__name__))
    monkeypatch.setitem(dense_ctx.cfg.train.options, "kv_cache_dtype", kv)
    c7.measure(dense_ctx)
    assert bool(used) == rounded, used


def test_an_fp8_kv_cache_on_the_train_side_alone_is_refused(example, workdir, tic):
    """The training forward's K/V must make the rollout's cache round trip: a train side with an FP8 KV cache the
    rollout does not have gets one line and exit 2, before anything is written."""
    ex = example("tiny-qwen3")
    (ex / "kv.yaml").write_text("model: {path: ., generate: {seed: 0}}\nrollout: {engine: hf}\n"
                                "train: {engine: hf, kernels: consistent, options: {kv_cache_dtype: fp8}}\n")
    code, _, err = tic("gate", "C5", "-c", str(ex / "kv.yaml"))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "differs from rollout" in err, err
    assert not (ex / ".tic").exists()


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-gemma2", "tiny-mistral-sliding", "tiny-nemotron-h"])
def test_the_references_attention_keeps_no_scores_for_backward_and_gives_eager_gradients(tmp_path, name):
    """C7's reference runs each model's own eager attention under checkpointing: autograd keeps no positions x
    positions tensor (the scores, 2.6 GiB a layer on a long real-shape row), and the gradients are plain eager
    attention's bit for bit (a softcapped, a sliding-window and a hybrid model too). A model without attention
    modules keeps its own."""
    from transformers import AutoModelForCausalLM

    from tic.harness.measure.lean_attention import use_lean_attention

    model_dir = _example_model_dir(tmp_path, name)
    T = 24
    ids = torch.randint(0, 64, (1, T), generator=torch.Generator().manual_seed(0))

    def run(lean: bool):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
        switched = use_lean_attention(model) if lean else 0
        square = []

        def keep(t):
            if t.dim() >= 2 and t.shape[-1] == t.shape[-2] == T and t.numel() > T * T:  # per head, not the mask
                square.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            loss = model(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).sum()
        loss.backward()
        return switched, square, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    plain_n, plain_square, plain = run(False)
    lean_n, lean_square, lean = run(True)
    assert lean_n > 0 and plain_square and not lean_square, (lean_n, plain_square, lean_square)
    assert plain.keys() == lean.keys() and all(torch.equal(plain[n], lean[n]) for n in plain)


def test_a_model_without_attention_keeps_its_own_forward(tmp_path):
    from transformers import AutoModelForCausalLM

    from tic.harness.measure.lean_attention import use_lean_attention

    model = AutoModelForCausalLM.from_pretrained(_example_model_dir(tmp_path, "tiny-mamba2"), dtype=torch.float32)
    assert use_lean_attention(model) == 0 and model.config._attn_implementation != "tic_lean_eager"


def test_an_attention_module_without_an_eager_function_to_run_keeps_the_model_as_it_is(tmp_path, monkeypatch):
    """A model one of whose attention modules comes from a modeling file without eager_attention_forward would
    find nothing to run under the checkpoint: the model keeps its own eager attention."""
    import sys

    from transformers import AutoModelForCausalLM

    from tic.harness.measure.lean_attention import use_lean_attention

    model = AutoModelForCausalLM.from_pretrained(_example_model_dir(tmp_path, "tiny-qwen3"), dtype=torch.float32,
                                                 attn_implementation="eager")
    home = sys.modules[type(model.model.layers[0].self_attn).__module__]
    monkeypatch.delattr(home, "eager_attention_forward")
    assert use_lean_attention(model) == 0 and model.config._attn_implementation == "eager"


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-nemotron-h"])
def test_the_references_head_runs_on_the_response_rows_alone(tmp_path, name):
    """C7's reference computes the logits of the rows that predict response tokens only: the head's input has
    R + 1 rows, not the whole sequence, and the response logits are those of the full forward."""
    from transformers import AutoModelForCausalLM

    from tic.harness.measure.gradcheck import response_logits, takes_logits_to_keep

    model = AutoModelForCausalLM.from_pretrained(_example_model_dir(tmp_path, name), dtype=torch.float32,
                                                 attn_implementation="eager")
    P, R = 17, 5
    ids = torch.randint(0, 64, (1, P + R), generator=torch.Generator().manual_seed(0))
    rows = []
    head = model.get_output_embeddings()
    head.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[-2]))
    assert takes_logits_to_keep(model)
    with torch.no_grad():
        kept = response_logits(model, ids, P, R, keep_only=True)
        full = response_logits(model, ids, P, R, keep_only=False)
    assert rows == [R + 1, P + R] and kept.shape == full.shape == (R, model.config.vocab_size)
    torch.testing.assert_close(kept, full, rtol=1e-5, atol=1e-5)
