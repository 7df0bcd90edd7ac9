"""Expert merges across EP degrees: the share of token rows bitwise equal to EP = 1, per merge, top-k and dtype.

Two gloo processes on 127.0.0.1 (EP = 2, tokens split unevenly between them as two DP ranks hold them) run
one seeded sparse-MoE layer with each merge of tic.harness.engines.parallel; EP = 1 is the same layer in one process
with the slot-order merge. A row counts as equal when all its D values are bitwise equal. Also: TP = 2
(row-parallel linear, partial products all-reduced) against TP = 1.

    .venv/bin/python benchmarks/bench_layouts.py [--tokens 256] [--dim 64] [--experts 8]
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tic.harness.engines.parallel import COMBINES, ExpertParallelMoE, RankPool, row_parallel_linear


def moe_block(experts: int, top_k: int, dim: int, dtype) -> SimpleNamespace:
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: (torch.randn(*s, generator=g) * 0.3).to(dtype)  # noqa: E731
    return SimpleNamespace(
        gate=SimpleNamespace(weight=rnd(experts, dim), top_k=top_k, norm_topk_prob=True),
        experts=SimpleNamespace(gate_up_proj=rnd(experts, dim, dim), down_proj=rnd(experts, dim, dim // 2),
                                act_fn=F.silu))


def moe_rank(state, x, combine, experts, top_k, dtype):
    block = moe_block(experts, top_k, x.shape[-1], dtype)
    return ExpertParallelMoE(block, dist.group.WORLD, 2, combine)(x)


def tp_rank(state, x, w):
    return row_parallel_linear(x, w)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--experts", type=int, default=8)
    a = ap.parse_args()
    with RankPool(2, timeout_s=600, threads=1) as pool:
        print(f"EP=2 vs EP=1: rows bitwise equal ({a.tokens} tokens, D={a.dim}, {a.experts} experts)")
        print("| dtype | top-k | " + " | ".join(COMBINES) + " |")
        print("|---|---|" + "---|" * len(COMBINES))
        for dtype in (torch.float32, torch.bfloat16):
            for k in (2, 3, 4, 8):
                g = torch.Generator().manual_seed(1)
                x = torch.randn(a.tokens, a.dim, generator=g).to(dtype)
                ref = ExpertParallelMoE(moe_block(a.experts, k, a.dim, dtype), None, 1)(x)
                cut = a.tokens // 2 - 5
                cells = []
                for comb in COMBINES:
                    got = torch.cat(pool.call(moe_rank, [(x[:cut], comb, a.experts, k, dtype),
                                                        (x[cut:], comb, a.experts, k, dtype)]))
                    cells.append(f"{100 * (got == ref).all(-1).float().mean().item():.1f} %")
                print(f"| {str(dtype)[6:]} | {k} | " + " | ".join(cells) + " |")
        print("\nTP=2 vs TP=1 (row-parallel linear, K = 4 x D): elements bitwise equal")
        print("| dtype | equal |\n|---|---|")
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(2)
            x = torch.randn(a.tokens, 4 * a.dim, generator=g).to(dtype)
            w = torch.randn(a.dim, 4 * a.dim, generator=g).to(dtype)
            got = pool.call(tp_rank, [(x, w), (x, w)])[0]
            print(f"| {str(dtype)[6:]} | {100 * (got == F.linear(x, w)).float().mean().item():.1f} % |")


if __name__ == "__main__":
    main()
