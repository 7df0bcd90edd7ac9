"""Each operator's written-out backward (autograd.py) against autograd through its float reference (*_ref), in
float64 with a tight tolerance, through the wrapper (CPU provider forward) on the cases that pick its branches:
padded and fully masked attention rows, MoE experts without tokens or with every token."""

import pytest
import torch
import torch.nn.functional as F

from tic.config.schema import BackwardConfig
from tic.harness.kernels import autograd as ag
from tic.harness.kernels.consistent_cpu import CPUProvider
from tic.harness.kernels.routing import Routing
from tic.harness.testing.backward_plants import planted_fault

G = torch.Generator().manual_seed(7)


def r(*shape):
    return torch.randn(*shape, generator=G, dtype=torch.float64)


def _leaf(t, grad=True):
    return t.detach().clone().requires_grad_(grad and t.is_floating_point()) if t is not None else None


def check(name, tensors, kw=None, seeds=None, rtol=1e-10, atol=1e-12, frozen=()):
    """Wrapper backward vs autograd through op.reference on the same output gradients; returns the wrapper's
    input gradients. `frozen`: positions of float inputs that need no gradient (a rotary table)."""
    kw = kw or {}
    op = ag.OPS[name]
    assert op.backward is not None
    leaves = [_leaf(t, i not in frozen) for i, t in enumerate(tensors)]
    out = ag.KernelFunction.apply(op, ag.Ops(CPUProvider()), kw, *leaves)
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o.is_floating_point()]
    seeds = seeds or [torch.randn(o.shape, generator=G, dtype=o.dtype) for o in outs]
    fixed = [o for o in (out if isinstance(out, tuple) else (out,)) if not o.is_floating_point()]
    torch.autograd.backward(outs, seeds)
    refs_in = [_leaf(t, i not in frozen) for i, t in enumerate(tensors)]
    ref = op.reference(*refs_in, *fixed, **kw)
    ref = list(ref) if isinstance(ref, tuple) else [ref]
    torch.autograd.backward(ref[:len(seeds)], seeds)
    for i, (a, b) in enumerate(zip(leaves, refs_in)):
        if a is not None and a.requires_grad:
            assert a.grad is not None and a.grad.dtype == a.dtype, (name, i)
            assert torch.allclose(a.grad, b.grad, rtol=rtol, atol=atol), (name, i, (a.grad - b.grad).abs().max())
    return [t.grad if t is not None else None for t in leaves]


def test_rms_norm_hidden_and_per_head():
    w = torch.nn.Parameter(r(16))
    check("rms_norm", (r(5, 16), w), {"eps": 1e-6})
    check("rms_norm", (r(2, 3, 4, 16) * 30, w), {"eps": 1e-5})  # q_norm/k_norm: [B, T, heads, D]


def test_add_rms_norm_both_outputs_and_one():
    w = torch.nn.Parameter(r(16))
    x, res = r(2, 3, 16), r(2, 3, 16)
    check("add_rms_norm", (x, res, w), {"eps": 1e-6})
    # only the normalised output feeds the loss (the sum's gradient is None)
    leaves = [t.detach().clone().requires_grad_() for t in (x, res, w)]
    y, _ = ag.KernelFunction.apply(ag.OPS["add_rms_norm"], ag.Ops(CPUProvider()), {"eps": 1e-6}, *leaves)
    seed = r(2, 3, 16)
    y.backward(seed)
    refs = [t.detach().clone().requires_grad_() for t in (x, res, w)]
    ag.add_rms_norm_ref(*refs, 1e-6)[0].backward(seed)
    for a, b in zip(leaves, refs):
        assert torch.allclose(a.grad, b.grad, rtol=1e-10, atol=1e-12)


def test_silu_and_mul():
    check("silu_and_mul", (r(2, 4, 18) * 4,))


def test_gelu_tanh_and_mul_softcap_and_the_gemma_norm():
    check("gelu_tanh_and_mul", (r(2, 4, 18) * 4,))
    check("softcap", (r(3, 40) * 60,), {"cap": 30.0})
    check("rms_norm", (r(2, 3, 16), r(16)), {"eps": 1e-6, "offset": 1.0})
    check("add_rms_norm", (r(2, 3, 16), r(2, 3, 16), r(16)), {"eps": 1e-6, "offset": 1.0})


@pytest.mark.parametrize("rot", [8, 4])  # full and partial rotary dims
def test_rotary(rot):
    check("rotary", (r(6, 4, 8), r(6, 2, 8), torch.tensor([0, 1, 2, 3, 0, 1]), r(10, rot)), frozen=(3,))


@pytest.mark.parametrize("rot", [8, 4])
def test_rotary_interleaved(rot):
    check("rotary_interleaved", (r(6, 4, 8), r(6, 2, 8), torch.tensor([0, 1, 2, 3, 0, 1]), r(10, rot)), frozen=(3,))


def test_rotary_with_a_trainable_table_falls_back_to_the_reference():
    table = torch.nn.Parameter(r(10, 8))
    check("rotary", (r(6, 4, 8), r(6, 2, 8), torch.tensor([0, 1, 2, 3, 0, 1]), table))


def _masks(T=6):
    ar = torch.arange(T)
    causal = ar[None, :] <= ar[:, None]
    right = causal & (ar[None, :] < 4)  # 2 right padding tokens (HF lets them see the valid keys)
    left = causal & (ar[None, :] >= 2) & (ar[:, None] >= 2)  # left padding: 2 fully masked rows
    seg = torch.tensor([0, 0, 0, 1, 1, 1])
    packed = causal & (seg[None, :] == seg[:, None])
    return causal, right, left, packed


@pytest.fixture
def sdpa_calls(monkeypatch):
    calls = []
    real = F.scaled_dot_product_attention

    def spy(*a, **kw):
        calls.append(kw)
        return real(*a, **kw)

    monkeypatch.setattr(ag.F, "scaled_dot_product_attention", spy)
    return calls


def _attention(mask, seed_rows=None, heads=(4, 2)):
    B = 1 if mask is None else mask.shape[0]
    q, k, v = r(B, heads[0], 6, 8), r(B, heads[1], 6, 8), r(B, heads[1], 6, 8)
    seed = r(B, 6, heads[0], 8)
    if seed_rows is not None:
        seed = seed * seed_rows[:, :, None, None].to(seed.dtype)
    return (q, k, v, mask), seed


def test_attention_right_padding_takes_the_causal_flag_when_padding_rows_get_no_gradient(sdpa_calls):
    causal, right, _, _ = _masks()
    mask = torch.stack([right, causal])[:, None]
    valid = torch.stack([torch.arange(6) < 4, torch.ones(6, dtype=torch.bool)])  # what the loss reads
    tensors, seed = _attention(mask, seed_rows=valid)
    check("attention", tensors, {"scale": 0.3}, seeds=[seed])
    backward_call = sdpa_calls[0]  # the wrapper's backward runs before the reference
    assert backward_call.get("is_causal") and "attn_mask" not in backward_call and backward_call["enable_gqa"]


def test_attention_right_padding_with_gradient_on_padding_rows_uses_the_mask(sdpa_calls):
    causal, right, _, _ = _masks()
    tensors, seed = _attention(torch.stack([right, causal])[:, None])
    check("attention", tensors, {"scale": 0.3}, seeds=[seed])
    assert "attn_mask" in sdpa_calls[0] and not sdpa_calls[0].get("is_causal")


@pytest.mark.parametrize("which", ["left", "packed", "none", "mha"])
def test_attention_general_masks(which, sdpa_calls):
    causal, right, left, packed = _masks()
    if which == "none":
        tensors, seed = _attention(None)
    elif which == "mha":
        tensors, seed = _attention(torch.stack([left, right])[:, None], heads=(3, 3))
    else:
        tensors, seed = _attention(torch.stack([left if which == "left" else packed, causal])[:, None])
    grads = check("attention", tensors, {"scale": 0.25}, seeds=[seed])
    if which == "left":  # fully masked query rows get no gradient
        assert (grads[0][0, :, :2] == 0).all()
    if which in ("left", "packed"):
        assert "attn_mask" in sdpa_calls[0]


@pytest.mark.parametrize("which", ["left", "packed", "none", "mha"])
def test_attention_with_sinks(which):
    """The sinks' own gradient too (one per query head, summed over its rows), and fully masked rows' none."""
    causal, _, left, packed = _masks()
    mask = None if which == "none" else torch.stack([left if which == "left" else packed, causal])[:, None]
    tensors, seed = _attention(mask, heads=(3, 3) if which == "mha" else (4, 2))
    sinks = torch.nn.Parameter(r(tensors[0].shape[1]))
    grads = check("attention_sinks", (*tensors, sinks), {"scale": 0.25}, seeds=[seed])
    assert grads[4] is not None and grads[4].abs().sum() > 0
    if which == "left":
        assert (grads[0][0, :, :2] == 0).all()


def test_attention_mask_rows_are_reread_when_the_mask_changes_in_place():
    causal, right, _, _ = _masks()
    mask = torch.stack([causal, causal])[:, None].clone()
    causal_rows = ag.Backward().causal_rows
    rows, all_causal = causal_rows.get(mask)
    assert all_causal
    mask[0, 0] = right  # same object, new contents
    rows, all_causal = causal_rows.get(mask)
    assert not all_causal and rows[0].tolist() == [True] * 4 + [False] * 2


@pytest.mark.parametrize("routing", [Routing(), Routing(renormalize=False),
                                     Routing("sigmoid", renormalize=True, biased=True, groups=2, topk_groups=1,
                                             scale=2.5),
                                     Routing("sigmoid", renormalize=False, scale=2.5),
                                     Routing("softmax", renormalize=True, biased=True)])
def test_moe_route(routing):
    bias = torch.randn(6, generator=G, dtype=torch.float64) if routing.biased else None
    check("moe_route", (r(7, 6),), {"top_k": 3, "routing": routing, "bias": bias})


def _experts(ids, E=4, H=8, I=5):
    T, k = ids.shape
    return (r(T, H), r(T, k).abs(), ids, torch.nn.Parameter(r(E, 2 * I, H) * 0.5),
            torch.nn.Parameter(r(E, H, I) * 0.5))


@pytest.mark.parametrize("ids", [
    [[0, 2], [1, 2], [2, 0], [1, 0], [2, 1]],  # expert 3 gets no token
    [[3, 0], [3, 1], [3, 2], [3, 0]],          # every token routed to expert 3
    [[1], [1], [1]],                            # top-1, one expert takes everything
], ids=["idle-expert", "all-to-one", "top1-single"])
def test_moe_experts(ids):
    grads = check("moe_experts", _experts(torch.tensor(ids)))
    used = set(torch.tensor(ids).flatten().tolist())
    for e in range(4):
        if e not in used:
            assert (grads[3][e] == 0).all() and (grads[4][e] == 0).all()


def test_moe_experts_without_tokens():
    x, w, ids, gu, d = _experts(torch.zeros(0, 2, dtype=torch.long))
    gx, gw, _, ggu, gd = ag._moe_experts_backward((x, w, ids, gu, d), (), (torch.zeros(0, 8, dtype=torch.float64),),
                                                  {}, (True, True, False, True, True), ag.Backward())
    assert gx.shape == (0, 8) and gw.shape == (0, 2) and not ggu.any() and not gd.any()


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no grouped GEMM")
def test_moe_experts_grouped_gemms_match_the_per_expert_loop_in_bf16(monkeypatch):
    """bf16 runs the experts' GEMMs as one grouped launch each; the per-expert loop (train.backward.grouped_mm off)
    and the float64 reference agree with it (same bf16 GEMMs; an idle expert's weight gradients are zero either
    way)."""
    ids = torch.tensor([[0, 2], [1, 2], [2, 0], [1, 0], [2, 1], [0, 1]])  # expert 3 idle
    x, w, _, gu, d = (t.detach() for t in _experts(ids, H=16, I=16))
    bf = [t.detach().to(torch.bfloat16) for t in (x, w, gu, d)]
    g = r(ids.shape[0], 16).to(torch.bfloat16)
    needs = (True, True, False, True, True)
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    run = ag.Backward()
    grouped = ag._moe_experts_backward((bf[0], bf[1], ids, bf[2], bf[3]), (), (g,), {}, needs, run)
    assert calls and not run.grouped_mm_errors, f"bf16 took the per-expert loop {run.grouped_mm_errors}"
    n = len(calls)
    loop = ag._moe_experts_backward((bf[0], bf[1], ids, bf[2], bf[3]), (), (g,), {}, needs,
                                    ag.Backward(BackwardConfig(grouped_mm=False)))
    assert len(calls) == n
    wide = ag._moe_experts_backward((x, w, ids, gu, d), (), (g.double(),), {}, needs, ag.Backward())
    for a, b, c in zip(grouped, loop, wide):
        if a is None:
            continue
        assert torch.allclose(a.double(), b.double(), rtol=2e-2, atol=2e-2)
        rel = float((a.double() - c).norm() / c.norm())
        assert rel < 2e-2, rel  # bf16 GEMMs against float64: C7's kind of agreement, not bits
    assert not grouped[3][3].any() and not grouped[4][3].any()


def test_log_softmax():
    check("log_softmax", (r(4, 13) * 3,))


def test_layer_norm_and_the_shared_expert_gate():
    check("layer_norm", (r(5, 16), r(16), r(16)), {"eps": 1e-5})
    check("layer_norm", (r(2, 3, 16), None, None), {"eps": 1e-5})
    check("layer_norm_float32", (r(5, 16), r(16), None), {"eps": 1e-5})  # CohereLayerNorm: weight, no bias
    check("layer_norm_float32", (r(2, 3, 16), r(16), r(16)), {"eps": 1e-5})
    check("sigmoid_gate", (r(6, 1), r(6, 12)))


@pytest.mark.parametrize("function", ["sigmoid", "softplus"])
def test_an_attentions_output_gate_per_feature_and_per_head(function):
    check("output_gate", (r(2, 3, 12) * 2, r(2, 3, 12)), {"function": function, "per_head": False})
    check("output_gate", (r(2, 3, 4) * 2, r(2, 3, 12)), {"function": function, "per_head": True})


@pytest.mark.parametrize("kind", ["gelu", "gelu_tanh", "relu", "silu"])
def test_an_ungated_mlps_activation(kind):
    check("activation", (r(4, 24) * 3,), {"kind": kind})


def test_every_operator_has_a_written_out_backward():
    assert all(op.backward is not None for op in ag.OPS.values())


def _wrapped() -> torch.nn.Module:
    m = torch.nn.Module()
    m._tic_ops = ag.Ops(CPUProvider())
    return m


def test_closed_form_backward_still_runs_the_weight_check_and_a_plant_in_its_own_model_only():
    """The weight check runs before the written-out backward; a plant (tic.harness.testing.backward_plants) changes
    that backward in the model it is planted into, runs its `before` ahead of the weight check, and is gone
    afterwards; another model's wrappers never see it."""
    w = torch.nn.Parameter(r(16))
    x = r(3, 16).requires_grad_()
    planted, other = _wrapped(), _wrapped()
    out = planted._tic_ops.rms_norm(x, w, 1e-6)
    with torch.no_grad():
        w.mul_(2)
    with pytest.raises(ag.StaleWeightError):
        out.sum().backward()
    x.grad = None
    with planted_fault(planted, "rms_norm", grads=lambda g: (-g[0], g[1])):
        planted._tic_ops.rms_norm(x, w, 1e-6).sum().backward()
        flipped = x.grad.clone()
        x.grad = None
        other._tic_ops.rms_norm(x, w, 1e-6).sum().backward()
    want = x.grad.clone()
    assert torch.allclose(flipped, -want)
    x.grad = None
    planted._tic_ops.rms_norm(x, w, 1e-6).sum().backward()
    assert torch.equal(x.grad, want)
    with planted_fault(planted, "rms_norm", before=lambda ws: ws[0].add_(1)):
        with pytest.raises(ag.StaleWeightError):
            planted._tic_ops.rms_norm(x, w, 1e-6).sum().backward()


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: where Backward.fused compiles."""

    @property
    def is_cuda(self):
        return True


@pytest.mark.parametrize("fuse", [True, False])
def test_backward_compiles_the_closed_forms_on_cuda_only_when_fuse_is_on(monkeypatch, fuse):
    """train.backward.fuse: on CUDA each closed form runs compiled (eager with fuse off, and on CPU); a compiler
    failure is kept in that model's compile_errors and the function runs eager from then on."""
    compiled = []

    def compile_or_fail(fn):
        def run(*args):
            compiled.append(fn.__name__)
            if len(compiled) > 1:
                raise RuntimeError("the compiler broke")
            return fn(*args)
        return run

    monkeypatch.setattr(ag, "_compiled", compile_or_fail)
    run = ag.Backward(BackwardConfig(fuse=fuse))
    x, g = r(3, 8), r(3, 4)
    want = ag._silu_and_mul_input_grad(x, g)
    assert torch.equal(run.fused(ag._silu_and_mul_input_grad, x, g), want) and compiled == []  # CPU: eager
    on_cuda = x.as_subclass(_OnCuda)
    for _ in range(3):
        assert torch.equal(run.fused(ag._silu_and_mul_input_grad, on_cuda, g), want)
    assert compiled == (["_silu_and_mul_input_grad"] * 2 if fuse else [])
    assert list(run.compile_errors) == (["_silu_and_mul_input_grad"] if fuse else [])
    assert ag.Backward().compile_errors == {}  # another model's backwards are its own


def test_closed_forms_compile_in_inductors_deterministic_mode_or_run_eagerly(monkeypatch):
    """Inductor picks a reduction's kernel by timing it in each process, and the candidates sum in other orders: a
    restored run's update then differed from the uninterrupted one (C9 on the GPU). The closed forms compile with
    its deterministic mode; a torch without that mode leaves them eager, the reason kept in compile_errors."""
    import torch._inductor.config as inductor

    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(kw) or fn)

    def fresh_silu_grad(x, g):  # a function of its own: _compiled caches per function
        return ag._silu_and_mul_input_grad(x, g)

    x, g = r(3, 8), r(3, 4)
    on_cuda = x.as_subclass(_OnCuda)
    assert torch.equal(ag.Backward().fused(fresh_silu_grad, on_cuda, g), ag._silu_and_mul_input_grad(x, g))
    assert calls == [{"dynamic": True, "options": {"deterministic": True}}]

    def older_silu_grad(x, g):
        return ag._silu_and_mul_input_grad(x, g)

    monkeypatch.delattr(inductor, "deterministic")
    run = ag.Backward()
    assert torch.equal(run.fused(older_silu_grad, on_cuda, g), ag._silu_and_mul_input_grad(x, g))
    assert len(calls) == 1 and "deterministic mode" in run.compile_errors["older_silu_grad"]
