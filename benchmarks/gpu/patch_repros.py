"""Minimal repros of the three bundled vLLM patches, each run without and with its patch (H200, vLLM 0.26).

  python benchmarks/gpu/patch_repros.py [--patched] [--json FILE]

Each case builds one kernel's inputs, computes the same rows in a small launch and inside a large one, and
counts rows whose bits differ. Without --patched the kernels run as vLLM 0.26 calls them; with --patched they
run through tic's patched entry points. Exit 1 if any case differs, 0 if none does (so: 1 without the patches
shows the bug is present, 0 with them shows each fix holds), 2 on bad use.
"""

from __future__ import annotations

import json
import sys

import torch

dev = "cuda"


def i32(x):
    return torch.tensor(x, dtype=torch.int32, device=dev)


def fa3_decode_vs_prefill(patched: bool, hq=8, hkv=2, d=64, L=400, block=16) -> dict:
    import vllm.v1.attention.backends.flash_attn as fa_mod

    fa = fa_mod.flash_attn_varlen_func  # the backend's own binding: patched or not
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(L, h, d, dtype=torch.bfloat16, device=dev, generator=g) for h in (hq, hkv, hkv))
    nb = (L + block - 1) // block
    kc = torch.zeros(nb, block, hkv, d, dtype=torch.bfloat16, device=dev)
    vc = torch.zeros_like(kc)
    kc.view(-1, hkv, d)[:L] = k
    vc.view(-1, hkv, d)[:L] = v
    bt = torch.arange(nb, dtype=torch.int32, device=dev)[None].contiguous()
    kw = dict(k=kc, v=vc, softmax_scale=d ** -0.5, causal=True, block_table=bt, fa_version=3,
              scheduler_metadata=None, num_splits=0)
    pre = fa(q=q, cu_seqlens_q=i32([0, L]), max_seqlen_q=L, seqused_k=i32([L]), max_seqlen_k=L, **kw)
    rows = 0
    for t in range(L):
        one = fa(q=q[t:t + 1], cu_seqlens_q=i32([0, 1]), max_seqlen_q=1, seqused_k=i32([t + 1]),
                 max_seqlen_k=t + 1, **kw)
        rows += int(not torch.equal(one[0], pre[t]))
    return {"rows": L, "rows_differing": rows, "head_dim": d}


def rmsnorm_small_vs_large(patched: bool, hidden: int, offset: int, n=6667, small=48) -> dict:
    """offset: start the input `offset` elements into its buffer (0: aligned; 1: not 16-byte aligned)."""
    import vllm._custom_ops as ops

    g = torch.Generator(device=dev).manual_seed(1)
    x0 = torch.randn(n * hidden + offset, dtype=torch.bfloat16, device=dev, generator=g)
    r0 = torch.randn(n, hidden, dtype=torch.bfloat16, device=dev, generator=g)
    w = torch.randn(hidden, dtype=torch.bfloat16, device=dev, generator=g)

    def run(rows):
        xb = torch.empty(rows * hidden + offset, dtype=torch.bfloat16, device=dev)
        x = xb[offset:].view(rows, hidden)
        x.copy_(x0[offset:].view(n, hidden)[:rows])
        r = r0[:rows].clone()
        ops.fused_add_rms_norm(x, r, w, 1e-6)  # the module attribute: patched or not
        return x, r

    xa, ra = run(n)
    xs, rs = run(small)
    return {"hidden": hidden, "misaligned": bool(offset), "rows": small,
            "rows_differing": int((xa[:small] != xs).any(dim=1).sum()), "residual_equal": bool(torch.equal(ra[:small], rs))}


def gemm_small_vs_large(patched: bool, n_out=8192, k=2048, n=6667, small=(1, 48)) -> dict:
    from vllm.model_executor.layers.utils import dispatch_unquantized_gemm

    gemm = dispatch_unquantized_gemm()  # patched: the fixed-order Triton GEMM; stock: F.linear
    g = torch.Generator(device=dev).manual_seed(2)
    x = torch.randn(n, k, dtype=torch.bfloat16, device=dev, generator=g)
    w = torch.randn(n_out, k, dtype=torch.bfloat16, device=dev, generator=g) * k ** -0.5
    full = gemm(None, x, w, None)
    out = {"gemm": getattr(gemm, "__name__", str(gemm)), "k": k, "n": n_out}
    for m in small:
        part = gemm(None, x[:m].clone(), w, None)
        out[f"rows_differing_m{m}_vs_m{n}"] = int((part != full[:m]).any(dim=1).sum())
    return out


def main(argv: list[str]) -> int:
    patched = "--patched" in argv
    if any(a.startswith("-") and a not in ("--patched", "--json") for a in argv):
        print(__doc__)
        return 2
    if patched:
        from tic import patches

        patches.apply(["fa3-fixed-tile", "rmsnorm-fixed-block", "gemm-fixed-order"])
    cases = {
        "fa3-fixed-tile: FA3 hd64 decode row vs prefill (400 tokens)": lambda: fa3_decode_vs_prefill(patched),
        "fa3-fixed-tile: FA3 hd128 decode row vs prefill (400 tokens)": lambda: fa3_decode_vs_prefill(patched, 16, 8, 128),
        "rmsnorm-fixed-block: hidden 2048 aligned, 48 vs 6667 rows": lambda: rmsnorm_small_vs_large(patched, 2048, 0),
        "rmsnorm-fixed-block: hidden 2048 misaligned, 48 vs 6667 rows": lambda: rmsnorm_small_vs_large(patched, 2048, 1),
        "rmsnorm-fixed-block: hidden 4096 aligned, 48 vs 6667 rows": lambda: rmsnorm_small_vs_large(patched, 4096, 0),
        "gemm-fixed-order: 2048->8192 linear, 1/48 vs 6667 rows": lambda: gemm_small_vs_large(patched),
        "gemm-fixed-order: 8192->2048 linear (down_proj), 1/48 vs 6667 rows": lambda: gemm_small_vs_large(patched, 2048, 8192),
        "gemm-fixed-order: 2048->151936 lm_head, 1/48 vs 2000 rows": lambda: gemm_small_vs_large(patched, 151936, 2048, 2000),
    }
    res, bad = {}, 0
    for name, fn in cases.items():
        r = fn()
        diff = sum(v for kk, v in r.items() if kk.startswith("rows_differing"))
        bad += diff > 0
        res[name] = r
        print(f"{'DIFF' if diff else 'same'}  {name}: {r}", flush=True)
    if "--json" in argv:
        import vllm

        res["_versions"] = {"vllm": vllm.__version__, "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
        with open(argv[argv.index("--json") + 1], "w") as f:
            json.dump({"patched": patched, "cases": res}, f, indent=1)
    print(f"{'patched' if patched else 'stock'}: {bad} of {len(cases)} cases differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
