"""One GPU run: tic's training step on vLLM's kernels (forward = vLLM kernel, backward = surrogate) vs a plain
HF training step on the same bf16 model and batch.

  source benchmarks/gpu/device_env.sh    # tic and the vLLM 0.26 bundle ($TIC_VLLM_SITE) on the path
  [TIC_PATCHES=fa3-fixed-tile,gemm-fixed-order,rmsnorm-rows] [VLLM_BATCH_INVARIANT=1] \
    python3 benchmarks/gpu/train_step_bench.py [--moe] [--batch 8 --seq 512] [--eager-backward] [--no-grouped-mm]

Checks, each printed with its verdict; any failure exits 1:
  1. every wrapper's forward value equals a direct call of vLLM's kernel on the same inputs, bit for bit;
  2. the wrapped model's gradients are within C7's bf16 tolerance of plain HF float32 on the same weights (MoE:
     the reference's routers pinned to the wrapped model's top-k choices with RoutingPin, as gates/c7.py does);
  3. time per step (forward + backward, median of --repeats) and peak memory of both steps, and the ratio
     (goal <= 1.3x; reported, and a miss is flagged, with --strict-time it fails the run).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time

import torch


def build_model(args, dtype):
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                  max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False)
    if args.moe:
        cfg = Qwen3MoeConfig(**common, moe_intermediate_size=args.hidden // 2, num_experts=16, num_experts_per_tok=4,
                             norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    else:
        cfg = Qwen3Config(**common, intermediate_size=args.hidden * 3)
    torch.manual_seed(0)
    cfg._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype).cuda()


def batch(args):
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(args.seq // 2, args.seq + 1, (args.batch,), generator=g).tolist()
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long)
    mask = torch.zeros(args.batch, args.seq, dtype=torch.long)
    for b, n in enumerate(lens):
        ids[b, :n] = torch.randint(0, args.vocab, (n,), generator=g)
        mask[b, :n] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    adv = torch.randn(args.batch, generator=g)
    return ids.cuda(), mask.cuda(), pos.cuda(), adv.cuda()


def f32_log_softmax(t):
    return t.float().log_softmax(-1)


def step(model, ids, mask, pos, adv, log_softmax):
    """Forward, a policy-gradient loss on the next-token logprobs of the valid tokens, backward."""
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits[:, :-1]
    lp = log_softmax(logits.reshape(-1, logits.shape[-1])).reshape(*logits.shape)
    tok = lp.gather(-1, ids[:, 1:, None])[..., 0]
    valid = (mask[:, 1:] * mask[:, :-1]).to(tok.dtype)
    loss = -(adv[:, None] * tok * valid).sum() / valid.sum()
    loss.backward()
    return loss


def timed(fn, repeats):
    """(median seconds per call, peak bytes allocated, peak bytes above what was resident before the calls)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    torch.cuda.reset_peak_memory_stats()
    resident = torch.cuda.memory_allocated()
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated()
    return statistics.median(times), peak, peak - resident


def profile_steps(*named_fns, top: int) -> None:
    """Per step: wall time, time the GPU spent in kernels (is the step bound by the GPU or by the host?), CUDA
    time per tic operator range (tic.forward.<op> / tic.backward.<op>, inclusive: kernels plus the gaps between
    them) and per kernel; then the host's Python functions by own time (cProfile) for the tic step."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    for name, fn in named_fns:
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t) / 3
        rows = prof.key_averages()
        dev = lambda r: getattr(r, "device_time_total", None) or getattr(r, "cuda_time_total", 0)  # noqa: E731
        kernels = sorted((r for r in rows if r.device_type.name == "CUDA" and not r.key.startswith("tic.")),
                         key=dev, reverse=True)
        busy = sum(dev(r) for r in kernels) / 3
        launches = sum(r.count for r in kernels) // 3
        print(f"\n   profile {name}: {wall * 1e3:.2f} ms per step (under the profiler), {busy / 1e3:.2f} ms of kernels "
              f"({launches} kernels) per step: GPU busy {100 * busy / 1e3 / (wall * 1e3):.0f} %")
        ranges = sorted((r for r in rows if r.key.startswith("tic.")), key=dev, reverse=True)
        for r in ranges[:top]:
            print(f"     {r.key:32s} {dev(r) / 3e3:9.3f} ms/step  {r.count // 3:5d} calls")
        for r in kernels[:top]:
            print(f"     {r.key[:90]:90s} {dev(r) / 3e3:9.3f} ms/step  {r.count // 3:5d} calls")
        if name == "tic":
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            pr.disable()
            print("\n   host Python, tic step (cProfile over 3 steps, by own time):")
            stats = pstats.Stats(pr)
            stats.sort_stats("tottime").print_stats(top)


# -- check 1: wrapper forward == direct vLLM kernel -----------------------------------------------------------
def kernel_checks(ops, moe: bool) -> list[tuple[str, bool, str]]:
    from vllm import _custom_ops as vops

    torch.manual_seed(2)
    bf = torch.bfloat16
    T, H, D, Hkv = 300, 16, 128, 8
    x, r = torch.randn(T, 1024, device="cuda", dtype=bf), torch.randn(T, 1024, device="cuda", dtype=bf)
    w = torch.randn(1024, device="cuda", dtype=bf)
    rows = []

    def check(name, got, want):
        got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
        ok = all(torch.equal(a, b) for a, b in zip(got, want)) and len(got) == len(want)
        diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, want)) if not ok else 0.0
        rows.append((name, ok, "bitwise equal" if ok else f"max |diff| {diff:g}"))

    bi = ops.provider.batch_invariant
    if bi:
        from vllm.model_executor.layers.batch_invariant import rms_norm_batch_invariant

        check("rms_norm", ops.rms_norm(x, w, 1e-6), rms_norm_batch_invariant(x, w, 1e-6))
        s = x + r
        check("add_rms_norm", ops.add_rms_norm(x, r, w, 1e-6), (rms_norm_batch_invariant(s, w, 1e-6), s))
    else:
        out = torch.empty_like(x)
        vops.rms_norm(out, x, w, 1e-6)
        check("rms_norm", ops.rms_norm(x, w, 1e-6), out)
        xi, ri = x.clone(), r.clone()
        vops.fused_add_rms_norm(xi, ri, w, 1e-6)
        check("add_rms_norm", ops.add_rms_norm(x, r, w, 1e-6), (xi, ri))
    gu = torch.randn(T, 2 * 3072, device="cuda", dtype=bf)
    out = torch.empty(T, 3072, device="cuda", dtype=bf)
    torch.ops._C.silu_and_mul(out, gu)
    check("silu_and_mul", ops.silu_and_mul(gu), out)
    wl = torch.randn(2048, 1024, device="cuda", dtype=bf)
    if "gemm-fixed-order" in ops.provider.patches:  # the patch's rule: its own GEMM, rows alone or together
        from tic.patches.vllm.fixed_order_gemm import linear as fixed_order

        check("gemm-fixed-order", ops.linear(x, [wl]), fixed_order(x, wl))
        check("gemm-fixed-order, 3 rows alone", ops.linear(x[:3].clone(), [wl]), fixed_order(x, wl)[:3])
    elif "gemm-fixed-m" not in ops.provider.patches:
        check("linear", ops.linear(x, [wl]), torch.nn.functional.linear(x, wl))
    else:  # the patch's rule is vLLM's GEMM per 128-row tile: its full tiles vs F.linear on each tile alone
        from tic.patches.vllm.gemm_fixed_m import ROWS

        got = ops.linear(x, [wl])
        check(f"gemm-fixed-m full tiles of {ROWS}", got[:2 * ROWS],
              torch.cat([torch.nn.functional.linear(x[s:s + ROWS].clone(), wl) for s in (0, ROWS)]))
    q, k = torch.randn(T, H, D, device="cuda", dtype=bf), torch.randn(T, Hkv, D, device="cuda", dtype=bf)
    pos = torch.arange(T, device="cuda")
    cs = torch.randn(4096, D, device="cuda", dtype=bf)
    qi, ki = q.reshape(T, -1).clone(), k.reshape(T, -1).clone()
    vops.rotary_embedding(pos, qi, ki, D, cs, True)
    check("rotary", ops.rotary(q, k, pos, cs), (qi.reshape(q.shape), ki.reshape(k.shape)))
    _attention_check(ops, check, H, D, Hkv)
    logits = torch.randn(64, 32768, device="cuda", dtype=bf)
    check("log_softmax", ops.log_softmax(logits), logits.log_softmax(dim=-1, dtype=torch.float32))
    if moe:
        _moe_checks(ops, check, T)
    return rows


def _attention_check(ops, check, H: int, D: int, Hkv: int) -> None:
    """Two right-padded rows of 300 and 180 tokens vs the varlen kernel on the packed tokens."""
    bf = torch.bfloat16
    L, lens = 300, [300, 180]
    qa = torch.randn(2, H, L, D, device="cuda", dtype=bf)
    ka, va = torch.randn(2, Hkv, L, D, device="cuda", dtype=bf), torch.randn(2, Hkv, L, D, device="cuda", dtype=bf)
    ar = torch.arange(L, device="cuda")
    mask = torch.stack([(ar[None] <= ar[:, None]) & (ar[None] < n) & (ar[:, None] < n) for n in lens])[:, None]
    got = ops.attention(qa, ka, va, mask, D ** -0.5)
    pack = lambda t: torch.cat([t[b, :, :n].transpose(0, 1) for b, n in enumerate(lens)]).contiguous()  # noqa: E731
    cu = torch.tensor([0, lens[0], sum(lens)], device="cuda", dtype=torch.int32)
    try:  # the entry vLLM's FlashAttention backend calls (patched there by fa3-fixed-tile when active)
        from vllm.v1.attention.backends.flash_attn import flash_attn_varlen_func
    except ImportError:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    want = flash_attn_varlen_func(pack(qa), pack(ka), pack(va), max_seqlen_q=L, cu_seqlens_q=cu, max_seqlen_k=L,
                                  cu_seqlens_k=cu, softmax_scale=D ** -0.5, causal=True,
                                  fa_version=ops.provider.fa_version)
    check("attention (varlen prefill)", torch.cat([got[b, :n] for b, n in enumerate(lens)]), want)


def _moe_checks(ops, check, T: int) -> None:
    from vllm.model_executor.layers.fused_moe import fused_experts, fused_topk

    bf = torch.bfloat16
    xm = torch.randn(T, 1024, device="cuda", dtype=bf)
    rl = torch.randn(T, 16, device="cuda", dtype=bf)
    tw, ti = fused_topk(rl, rl, 4, True)[:2]
    gw, ids = ops.moe_route(rl, 4, True)
    check("moe_route", (gw, ids), (tw.float(), ti.long()))
    w13 = torch.randn(16, 1024, 1024, device="cuda", dtype=bf) * 0.03
    w2 = torch.randn(16, 1024, 512, device="cuda", dtype=bf) * 0.03
    check("moe_experts", ops.moe_experts(xm, gw, ids, w13, w2),
          fused_experts(xm, w13, w2, tw, ti))


def sdpa_backends(args) -> str:
    """Which of torch's fused SDPA backends accept the attention backward's two calls at this shape (bf16, GQA):
    the causal-flag call (right padding, no mask) and the bool-mask call (left padding or packing). torch
    takes the first eligible in its priority order (cuDNN first where it prefers it, then flash, then
    memory-efficient); --profile's kernel rows name the one it ran."""
    D, Hkv = args.hidden // args.heads, args.kv_heads
    q = torch.zeros(args.batch, args.heads, args.seq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.zeros(args.batch, Hkv, args.seq, D, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(args.batch, 1, args.seq, args.seq, device="cuda", dtype=torch.bool).tril()
    b = torch.backends.cuda
    out = []
    for what, m, causal in (("causal flag", None, True), ("bool mask", mask, False)):
        try:
            params = b.SDPAParams(q, k, k, m, 0.0, causal, Hkv != args.heads)
            ok = [n for n, f in (("cudnn", b.can_use_cudnn_attention), ("flash", b.can_use_flash_attention),
                                 ("efficient", b.can_use_efficient_attention)) if f(params, False)]
        except (AttributeError, TypeError, RuntimeError) as e:  # SDPAParams' signature moved between releases
            ok = [f"unknown ({type(e).__name__})"]
        out.append(f"{what}: {', '.join(ok) or 'math only'}")
    return "; ".join(out)


def check_gradients(args, provider, plain, wrapped, data) -> bool:
    """Check 2: the wrapped bf16 model's gradients vs plain HF float32 on the same weights and loss; True if any
    tensor is outside C7's bf16 tolerance (or a router could not be pinned)."""
    from tic.gates.c7 import DEFAULT_THRESHOLDS
    from tic.harness.kernels.modules import capture_routes
    from tic.harness.kernels.rope import hf_cos_sin_cache
    from tic.harness.measure.gradcheck import RoutingPin, compare

    ids, mask, pos, adv = data
    failed = False
    print("\n2. gradients of the wrapped bf16 model vs plain HF float32 (same weights, same loss; MoE routers of "
          "the reference take the wrapped model's top-k experts, as C7 pins them)")
    wrapped.zero_grad(set_to_none=True)
    with capture_routes(wrapped) as calls:
        step(wrapped, ids, mask, pos, adv, wrapped._tic_ops.log_softmax)
    routes = {name: torch.cat(c) for name, c in calls.items()}
    ref = copy.deepcopy(plain).float()
    ref.zero_grad(set_to_none=True)
    pin = RoutingPin(ref)
    with pin.pinned(routes) if pin.gates else contextlib.nullcontext():
        step(ref, ids, mask, pos, adv, f32_log_softmax)
    if pin.gates:
        print(f"   routing pinned in {len(pin.gates)} routers ({len(pin.unpinned)} unpinned), {pin.tokens} routed "
              f"tokens; the float32 reference alone would have chosen other experts for {pin.flips}")
        failed |= bool(pin.unpinned)
    grads = {n: p.grad.float().cpu() for n, p in wrapped.named_parameters() if p.grad is not None}
    rows = compare(grads, {n: p.grad.float().cpu() for n, p in ref.named_parameters() if p.grad is not None})
    del ref
    lo, hi = DEFAULT_THRESHOLDS["low"]
    bad = [r for r in rows if not (r["cosine"] >= lo and r["rel_error"] <= hi)]
    print(f"   {len(rows) - len(bad)}/{len(rows)} tensors within cosine >= {lo}, rel err <= {hi}; min cosine "
          f"{min(r['cosine'] for r in rows):.5f}, max rel err {max(r['rel_error'] for r in rows):.4f}")
    for r in bad[:5]:
        print(f"   FAIL {r['parameter']}: cosine {r['cosine']:.5f}, rel err {r['rel_error']:.4f}")
    failed |= bool(bad) or len(rows) != len(list(wrapped.parameters()))

    rope = wrapped.model.rotary_emb._tic_rope
    table = rope.get(args.seq, "cuda")
    hf_table = hf_cos_sin_cache(wrapped.model.rotary_emb, table.shape[0], table.dtype, "cuda")
    print(f"   rotary table: {provider.rope_source}; equal to the HF rotary module's: "
          f"{torch.equal(table, hf_table)}")
    return failed


def backward_paths(args, provider, wrapped) -> None:
    """Which backward paths the tic step took: grouped expert GEMMs, compiled closed forms, gemm-fixed-m's tiles."""
    backward = wrapped._tic_ops.backward
    if args.moe:
        grouped = backward.grouped_mm(next(wrapped.parameters()))
        why = backward.grouped_mm_errors[0] if backward.grouped_mm_errors else \
            "not bf16, or --no-grouped-mm, or no torch._grouped_mm"
        print(f"   experts' backward GEMMs: {'grouped (torch._grouped_mm)' if grouped else 'one by one (' + why + ')'}")

    print(f"   closed-form backwards {'eager (--eager-backward)' if args.eager_backward else 'compiled on the GPU'}: "
          f"{'no compile errors' if not backward.compile_errors else backward.compile_errors}")
    if "gemm-fixed-m" in provider.patches:
        from tic.patches.vllm import gemm_fixed_m

        probed = gemm_fixed_m._state.get("same_bits", {})
        print("   gemm-fixed-m full tiles, probed problems (how, tiles, weight shape): "
              + "; ".join(f"{k[0]} x{k[1]} {k[2]}: {'same bits' if v else 'differs'}" for k, v in probed.items()))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--moe", action="store_true", help="a Qwen3-MoE model (16 experts, top-4) instead of dense")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--strict-time", action="store_true", help="fail the run when the step ratio misses 1.3x")
    ap.add_argument("--eager-backward", action="store_true",
                    help="the closed-form backwards eager, not compiled (tic.yaml train.backward.fuse: false)")
    ap.add_argument("--no-grouped-mm", action="store_true",
                    help="the experts' backward GEMMs one by one (tic.yaml train.backward.grouped_mm: false)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also profile 3 steps of each and print the N largest CUDA-time rows: tic's per-operator "
                         "forward/backward ranges, then kernels")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("FAIL: no CUDA GPU")
        return 1

    from tic.config.schema import BackwardConfig
    from tic.harness.kernels.modules import apply
    from tic.harness.kernels.providers import provider_for

    import vllm

    provider = provider_for("vllm")
    print(f"vLLM {vllm.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}, "
          f"batch-invariant {provider.batch_invariant}, flash-attn v{provider.fa_version}, "
          f"patches {','.join(provider.patches) or 'none'} (TIC_PATCHES)")
    failed = False

    from tic.harness.kernels.autograd import Ops

    print("\n1. wrapper forward vs direct vLLM kernel call")
    for name, ok, what in kernel_checks(Ops(provider), args.moe):
        print(f"   {'ok  ' if ok else 'FAIL'} {name:28s} {what}")
        failed |= not ok

    plain = build_model(args, torch.bfloat16)
    plain.requires_grad_(True)
    wrapped = copy.deepcopy(plain)
    apply(wrapped, provider, BackwardConfig(fuse=not args.eager_backward, grouped_mm=not args.no_grouped_mm))
    ids, mask, pos, adv = batch(args)
    failed |= check_gradients(args, provider, plain, wrapped, (ids, mask, pos, adv))

    print(f"\n3. training step, batch {args.batch} x {args.seq} tokens (right padded), {args.layers} layers, "
          f"hidden {args.hidden}{', MoE' if args.moe else ''}, median of {args.repeats}")
    plain_fn = lambda: (plain.zero_grad(set_to_none=True),  # noqa: E731
                        step(plain, ids, mask, pos, adv, f32_log_softmax))
    tic_fn = lambda: (wrapped.zero_grad(set_to_none=True),  # noqa: E731
                      step(wrapped, ids, mask, pos, adv, wrapped._tic_ops.log_softmax))
    wrapped.zero_grad(set_to_none=True)
    t_plain, m_plain, d_plain = timed(plain_fn, args.repeats)
    plain.zero_grad(set_to_none=True)
    t_tic, m_tic, d_tic = timed(tic_fn, args.repeats)
    ratio = t_tic / t_plain
    print("   (peak: all allocated memory, both models' weights resident; step: the peak above what was resident "
          "before the step)")
    print(f"   {'step':28s} {'time/step (ms)':>15s} {'peak (GiB)':>11s} {'step peak (GiB)':>16s}")
    for name, t, m, d in (("plain HF (sdpa, cuBLAS)", t_plain, m_plain, d_plain),
                          ("tic on vLLM kernels", t_tic, m_tic, d_tic)):
        print(f"   {name:28s} {1e3 * t:15.2f} {m / 2**30:11.2f} {d / 2**30:16.2f}")
    print(f"   ratio tic/plain: time {ratio:.2f}x (goal <= 1.3x{'' if ratio <= 1.3 else ', MISSED'}), "
          f"step memory {d_tic / max(d_plain, 1):.2f}x")
    print(f"   attention backward, fused SDPA backends eligible: {sdpa_backends(args)}")
    backward_paths(args, provider, wrapped)
    if args.profile:
        profile_steps(("plain", plain_fn), ("tic", tic_fn), top=args.profile)
    if args.strict_time and ratio > 1.3:
        failed = True
    print("\nRESULT:", "FAIL" if failed else "ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
