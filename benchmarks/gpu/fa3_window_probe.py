"""Does a sliding-window attention row computed in a decode step equal the same row in the prefill? vLLM's FA3
varlen kernel on a paged KV cache, compared bit for bit, row by row.

  python benchmarks/gpu/fa3_window_probe.py [--tokens 2048] [--out FILE]

One sequence of `--tokens` random query/key/value rows sits in a paged cache (16-token pages, as vLLM's). The
prefill scores every row in one call. The decode scores each row p as vLLM's decode step does: one query row, the
keys 0..p. All rows go in one decode call: each is its own sequence whose block table points at the same pages.
A chunked prefill (queries s..end against all keys) shows whether a row's bits follow where its query tile starts
(found: on a windowed layer they do, whatever the decode's max_seqlen_q).

Variants: head_dim, window, softcap, the max_seqlen_q the decode call is launched with (1 = vLLM's own, 128 =
fa3-fixed-tile's pin, and larger), and every call through tic's fa3-fixed-tile (prefixed "tic":
the pin, and a windowed call's rows each as a sequence of their own). Prints a table of rows that differ; writes it
as JSON with --out. Exits 1 when a row differs through tic's launch, 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys

PAGE = 16
SHAPES = ((64, 4, 2), (128, 8, 2), (256, 8, 4), (256, 16, 8))  # (head_dim, query heads, KV heads)
WINDOWS = (None, 31, 127, 511, 1023)
PINS = (1, 128, 256, 1024)
CHUNK_STARTS = (1, 7, 64, 100, 333)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--out")
    a = ap.parse_args()
    import torch
    from vllm.vllm_flash_attn import flash_attn_varlen_func as stock

    from tic.patches.vllm.fa3_fixed_tile import _pin

    launches = {"": stock, "tic ": _pin(stock)}  # as vLLM calls FA3, and through tic's fa3-fixed-tile

    dev = "cuda"
    n = a.tokens
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []

    def attend(q, k_cache, v_cache, cu_q, max_q, seqused, max_k, table, d, window, softcap, version, how=""):
        return launches[how](
            q=q, k=k_cache, v=v_cache, cu_seqlens_q=cu_q, max_seqlen_q=max_q, seqused_k=seqused,
            max_seqlen_k=max_k, softmax_scale=d ** -0.5, causal=True,
            window_size=None if window is None else [window, 0], block_table=table, softcap=softcap,
            fa_version=version, num_splits=1, scheduler_metadata=None)

    for d, hq, hk in SHAPES:
        pages = (n + PAGE - 1) // PAGE
        q = torch.randn(n, hq, d, device=dev, generator=g).to(torch.bfloat16)
        # unused cache slots hold other values, as a live cache's do
        k_cache = torch.randn(pages + 8, PAGE, hk, d, device=dev, generator=g).to(torch.bfloat16)
        v_cache = torch.randn(pages + 8, PAGE, hk, d, device=dev, generator=g).to(torch.bfloat16)
        table1 = torch.arange(pages, device=dev, dtype=torch.int32)[None]
        i32 = dict(device=dev, dtype=torch.int32)

        def compare(base):
            """Rows of one variant: the decode at each pin and the chunked prefills, each against the prefill."""
            d, window, softcap, version, how = (base[k] for k in ("d", "window", "softcap", "version", "how"))
            whole = attend(q, k_cache, v_cache, torch.tensor([0, n], **i32), n, torch.tensor([n], **i32), n,
                           table1, d, window, softcap, version, how)
            out = []
            for pin in PINS if not how else (1,):
                dec = attend(q, k_cache, v_cache, torch.arange(n + 1, **i32), pin, torch.arange(1, n + 1, **i32),
                             n, table1.expand(n, -1).contiguous(), d, window, softcap, version, how)
                out.append((f"{how}decode max_seqlen_q={pin}", (dec != whole).flatten(1).any(1), 0))
            for s in CHUNK_STARTS:
                part = attend(q[s:], k_cache, v_cache, torch.tensor([0, n - s], **i32), n - s,
                              torch.tensor([n], **i32), n, table1, d, window, softcap, version, how)
                out.append((f"{how}chunk from {s}", (part != whole[s:]).flatten(1).any(1), s))
            return [{**base, "kind": kind, "differ": int(m.sum()), "of": int(m.numel()),
                     "first": int(m.nonzero()[0]) + s if m.any() else None} for kind, m, s in out]

        for window in WINDOWS:
            for softcap in (0.0, 50.0):
                if softcap and window not in (None, 31):
                    continue
                for version, how in ((3, ""), (3, "tic ")):
                    base = dict(d=d, hq=hq, hk=hk, window=window, softcap=softcap, version=version, how=how)
                    try:
                        rows.extend(compare(base))
                    except Exception as e:  # an FA build without this variant: say so, go on
                        rows.append({**base, "kind": "any", "error": str(e).splitlines()[0][:160]})

    print(f"{'fa':<3} {'d':>4} {'hq/hk':>6} {'window':>6} {'cap':>4}  {'comparison':<26} rows differing")
    for r in rows:
        cell = r.get("error") or f"{r['differ']}/{r['of']}" + (f" (first {r['first']})" if r.get("first") is not None else "")
        print(f"{r['version']:<3} {r['d']:>4} {r['hq']}/{r['hk']:<4} {str(r['window']):>6} {r['softcap']:>4.0f}  "
              f"{r['kind']:<26} {cell}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"tokens": n, "page": PAGE, "rows": rows}, f, indent=1)
    bad = [r for r in rows if r["how"] and r.get("differ")]  # through tic's launch, any row that differs
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
