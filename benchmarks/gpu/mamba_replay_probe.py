"""Does a Mamba-2 token decoded by replaying its chunk get the prefill's bits on vLLM's own kernels, and how far
from them is vLLM 0.26's single-step decode?

  python benchmarks/gpu/mamba_replay_probe.py [--prefix 300] [--decode 300] [--stock]

Per layer shape (real models' heads, head_dim, state, groups, chunk), bf16 inputs: one prefill of prefix + decode
tokens through vLLM's chunked scan, called as tic's vLLM provider calls it (tic.harness.kernels.vllm_mamba), against
  replay   the prefix prefilled, then each later token from its chunk's start state with the chunk's earlier tokens
           (the provider's decode, and the premise of the decode patch guides/ops/recurrent-layers.md designs);
  patch    the decode patch's own device-side step (mamba_decode_replay._decode_step: the chunk padded to
           chunk_size, one scan from the start state), a padding row beside it;
  1st chunk  the same step from a 5-token prefix: rows of a sequence's first chunk, scanned from a zero start
           state where the prefill had none;
  vllm     the prefix prefilled, then vLLM's decode: `selective_state_update` from the prefill's final state.
The causal conv alike: `causal_conv1d_fn` over the whole sequence against the provider's per-token replay (from a
conv state; its largest difference and how many elements differ), the same token run as a fresh sequence with
its K-1 predecessors, and vLLM's `causal_conv1d_update`. Prints rows equal out of the decoded ones; exits 1 when
a replayed row differs.
Without --stock the SSD kernels run on the mamba-ssd-fixed-config patch's one config, as the t-mamba2/t-nemotron-h
configs run them.
"""

from __future__ import annotations

import argparse
import sys

SHORT_PREFIX = 5  # the patch step's second run starts in the first chunk
SHAPES = (  # name, heads, head_dim, state, groups, chunk_size, conv kernel
    ("nemotron-h-8b", 128, 64, 128, 8, 128, 4),
    ("mamba2-2.7b", 80, 64, 128, 1, 256, 4),
    ("mamba2-130m", 24, 64, 128, 1, 256, 4),
)


def _inputs(L, H, P, N, G, g, dtype):
    import torch

    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    return dict(x=r(L, H, P).to(dtype), dt=(r(L, H) - 2).to(dtype), B=r(L, G, N).to(dtype), C=r(L, G, N).to(dtype),
                A_log=torch.log(1 + 15 * torch.rand(H, device="cuda", generator=g)).to(dtype),
                dt_bias=(0.5 * r(H)).to(dtype), D=r(H).to(dtype))


def _scan_rows(prov, t, Q, p0):
    """(full prefill rows of every token, replayed rows of tokens p0.., vLLM single-step rows of tokens p0..) as
    float32 [n, H, P]."""
    import torch
    from vllm.model_executor.layers.mamba.ops.mamba_ssm import selective_state_update
    from vllm.model_executor.layers.mamba.ops.ssd_combined import mamba_chunk_scan_combined_varlen
    from vllm.v1.attention.backends.mamba2_attn import compute_varlen_chunk_metadata

    x, dt, B, C = t["x"], t["dt"], t["B"], t["C"]
    L, H, P = x.shape
    G, N = B.shape[1:]
    lim = dict(chunk_size=Q, dt_min=0.0, dt_max=float("inf"))
    zero = lambda *s, d=x.dtype: torch.zeros(*s, dtype=d, device="cuda")  # noqa: E731
    params = (t["A_log"], t["dt_bias"], t["D"])
    full, _ = prov.mamba_scan(x, dt, B, C, *params, zero(H, P, N, d=torch.float32), zero(0, H, P), zero(0, H),
                              zero(0, G, N), **lim)
    _, S = prov.mamba_scan(x[:p0], dt[:p0], B[:p0], C[:p0], *params, zero(H, P, N, d=torch.float32), zero(0, H, P),
                           zero(0, H), zero(0, G, N), **lim)
    replay = []
    for i in range(p0, L):
        lo = i // Q * Q
        y, S = prov.mamba_scan(x[i:i + 1], dt[i:i + 1], B[i:i + 1], C[i:i + 1], *params, S, x[lo:i], dt[lo:i],
                               B[lo:i], **lim)
        replay.append(y)
    # vLLM's own decode, as MambaMixer2 calls it: the prefill's final state, then one state update per token
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device="cuda")  # noqa: E731
    cu, last, seq = compute_varlen_chunk_metadata(i32([0, p0]), Q)
    state = mamba_chunk_scan_combined_varlen(
        x[:p0], dt[:p0], -torch.exp(t["A_log"].float()), B[:p0], C[:p0], chunk_size=Q, cu_seqlens=i32([0, p0]),
        cu_chunk_seqlens=cu, last_chunk_indices=last, seq_idx=seq, out=torch.empty_like(x[:p0]), D=t["D"],
        dt_bias=t["dt_bias"], dt_softplus=True, state_dtype=torch.float32).contiguous()
    A = (-torch.exp(t["A_log"].float()))[:, None, None].expand(-1, P, N)
    out = torch.empty_like(x[p0:])
    # the state in cache line 1: vLLM's line NULL_BLOCK_ID (0) is padding, which its kernels skip
    states = torch.zeros(2, *state.shape[1:], dtype=state.dtype, device="cuda")
    states[1] = state[0]
    for i in range(p0, L):
        selective_state_update(states, x[i:i + 1], dt[i:i + 1, :, None].expand(-1, -1, P), A, B[i:i + 1],
                               C[i:i + 1], t["D"][:, None].expand(-1, P), t["dt_bias"][:, None].expand(-1, P),
                               dt_softplus=True, state_batch_indices=i32([1]), dst_state_batch_indices=i32([1]),
                               out=out[i - p0:i - p0 + 1])
    return full, torch.cat(replay), out.float()


def _conv_rows(prov, L, dim, K, p0, g, dtype):
    """(full rows, replayed rows, vLLM update rows, fresh rows) of the conv's tokens p0.., [n, dim]. Fresh: each
    token with its K-1 predecessors run as a sequence of their own without an initial state (the last row kept),
    so the kernel reads every input from x as the prefill does, none from a conv state."""
    import torch
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update

    u = torch.randn(L, dim, device="cuda", generator=g).to(dtype)
    w = (0.5 * torch.randn(dim, 1, K, device="cuda", generator=g)).to(dtype)
    bias = (0.1 * torch.randn(dim, device="cuda", generator=g)).to(dtype)
    full = prov.mamba_conv(u, torch.zeros(K - 1, dim, dtype=dtype, device="cuda"), w, bias)
    replay = torch.cat([prov.mamba_conv(u[i:i + 1], u[i - K + 1:i], w, bias) for i in range(p0, L)])
    conv_state = torch.zeros(2, K - 1, dim, dtype=dtype, device="cuda")  # line 0: vLLM's null block (padding)
    conv_state[1] = u[p0 - K + 1:p0]
    conv_state = conv_state.transpose(-1, -2)  # [2, dim, K-1], as MambaMixer2 hands vLLM's cache to the kernel
    steps = [causal_conv1d_update(u[i:i + 1].clone(), conv_state, w.view(dim, K), bias, "silu",
                                  conv_state_indices=torch.tensor([1], dtype=torch.int32, device="cuda"))
             for i in range(p0, L)]
    zeros = torch.zeros(K - 1, dim, dtype=dtype, device="cuda")
    fresh = torch.cat([prov.mamba_conv(u[i - K + 1:i + 1], zeros, w, bias)[-1:] for i in range(p0, L)])
    return full[p0:], replay, torch.cat(steps), fresh


def _patch_step_rows(t, Q, p0):
    """Tokens p0.. decoded by mamba-decode-replay's device-side step (the one a CUDA graph holds) on vLLM's scan,
    one token per step beside a padding row, from the state the patch's prefill leaves: the start state of the
    chunk the prefix ends in and that chunk's tokens so far. float32 [n, H, P]."""
    import torch
    from vllm.model_executor.layers.mamba.ops.ssd_combined import mamba_chunk_scan_combined_varlen as scan
    from vllm.v1.attention.backends.mamba2_attn import compute_varlen_chunk_metadata

    from tic.patches.vllm import mamba_decode_replay as decode_patch

    x, dt, B, C = t["x"], t["dt"], t["B"], t["C"]
    L, H, P = x.shape
    G, N = B.shape[1:]
    A = -torch.exp(t["A_log"].float())
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device="cuda")  # noqa: E731
    state = torch.zeros(2, H, P, N, dtype=torch.float32, device="cuda")
    lo = p0 // Q * Q
    if lo:  # the start state of the chunk the prefix ends in: the prefill of the whole chunks before it
        cu, last, seq = compute_varlen_chunk_metadata(i32([0, lo]), Q)
        state[1] = scan(x[:lo], dt[:lo], A, B[:lo], C[:lo], chunk_size=Q, cu_seqlens=i32([0, lo]),
                        cu_chunk_seqlens=cu, last_chunk_indices=last, seq_idx=seq, out=torch.empty_like(x[:lo]),
                        D=t["D"], dt_bias=t["dt_bias"], dt_softplus=True, state_dtype=torch.float32)[0]
    zeros = lambda *s, d=x.dtype: torch.zeros(*s, dtype=d, device="cuda")  # noqa: E731
    store = decode_patch._Chunks(zeros(2, Q, H, P), zeros(2, Q, H), zeros(2, Q, G, N),
                           i32([0, p0 - lo]), torch.tensor([0, p0], device="cuda"), None)
    store.x[1, :p0 - lo], store.dt[1, :p0 - lo], store.B[1, :p0 - lo] = x[lo:p0], dt[lo:p0], B[lo:p0]
    slots, rows = i32([1, -1]), []
    for i in range(p0, L):
        pick = lambda v: torch.cat([v[i:i + 1], v[i:i + 1]])  # noqa: E731  (the second row is padding)
        out = torch.zeros(2, H, P, dtype=x.dtype, device="cuda")
        decode_patch._decode_step(scan, store, state, slots, pick(x), pick(dt), A, pick(B), pick(C), t["D"],
                            t["dt_bias"], out, Q)
        rows.append(out[:1].float())
    return torch.cat(rows)


def _equal_rows(a, b) -> int:
    return int((a.reshape(a.shape[0], -1) == b.reshape(b.shape[0], -1)).all(dim=1).sum())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", type=int, default=300)
    ap.add_argument("--decode", type=int, default=300)
    ap.add_argument("--stock", action="store_true", help="the SSD kernels' own autotuning (no patch)")
    a = ap.parse_args()
    import torch

    from tic import patches
    from tic.harness.kernels.vllm_mamba import VLLMMambaKernels

    patches.apply([] if a.stock else ["mamba-ssd-fixed-config"])
    prov, g, dtype = VLLMMambaKernels(), torch.Generator(device="cuda").manual_seed(0), torch.bfloat16
    L, p0, failed = a.prefix + a.decode, a.prefix, False
    print(f"{a.decode} tokens decoded after a {p0}-token prefill; rows equal to the whole sequence's prefill "
          f"(patches: {', '.join(patches.active()) or 'none'})")
    print(f"{'shape':<16} {'scan replay':>12} {'patch step':>11} {'1st chunk':>10} {'scan vllm':>10} "
          f"{'vllm max|d|':>12} {'conv replay':>12} {'replay max|d|':>13} {'elements off':>12} {'conv fresh':>11} "
          f"{'conv vllm':>10}")
    for name, H, P, N, G, Q, K in SHAPES:
        t = _inputs(L, H, P, N, G, g, dtype)
        whole, replay, single = _scan_rows(prov, t, Q, p0)
        full, stepped, early = whole[p0:], _patch_step_rows(t, Q, p0), _patch_step_rows(t, Q, SHORT_PREFIX)
        es = _equal_rows(whole[SHORT_PREFIX:], early)
        cfull, creplay, cupdate, cfresh = _conv_rows(prov, L, H * P + 2 * G * N, K, p0, g, dtype)
        rs, ps, cs = _equal_rows(full, replay), _equal_rows(full, stepped), _equal_rows(cfull, creplay)
        failed |= rs < a.decode or cs < a.decode or ps < a.decode or es < L - SHORT_PREFIX
        off = int((cfull != creplay).sum())  # how many elements of the replayed rows differ (all, or a few lanes)
        print(f"{name:<16} {rs:>5}/{a.decode:<6} {ps:>4}/{a.decode:<6} {es:>4}/{L - SHORT_PREFIX:<5} "
              f"{_equal_rows(full, single):>4}/{a.decode:<5} {float((full - single).abs().max()):>12.3e} "
              f"{cs:>5}/{a.decode:<6} "
              f"{float((cfull.float() - creplay.float()).abs().max()):>13.3e} {off:>5}/{cfull.numel():<6} "
              f"{_equal_rows(cfull, cfresh):>4}/{a.decode:<6} {_equal_rows(cfull, cupdate):>4}/{a.decode:<5}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
