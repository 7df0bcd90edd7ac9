"""What vLLM's router does with a router of the DeepSeek-V3 kind (sigmoid scores, a selection bias, grouped top-k,
routed_scaling_factor), before tic lets `kernels: vllm` run one: the first GPU step toward `moe:score_router` on the
vLLM side (guides/ops/topk-routing.md).

  python benchmarks/gpu/score_router_probe.py [--experts 160] [--top-k 8] [--rows 4096]

For each rule (GLM-4.5's, DeepSeek-V3's groups, one without groups, one without a bias), vLLM's own router
(`create_fused_moe_router(...)`, as its FusedMoE builds it, with the scale on the weights) routes seeded float32
logits. Printed per rule:
  - launch shape: rows routed in launches of 1, 7 and 64 rows against one launch of all of them, ids and weights
    compared bit for bit (the rollout decodes a few rows per step, the training forward routes all at once);
  - tic's rule: tic.harness.kernels.routing on the same logits in float32 on the CPU: rows whose expert set
    differs (ties aside), and the largest relative weight difference on the rows that agree;
  - scale placement: the weights with routed_scaling_factor given to the router, against the weights without it
    times the factor (the two places vLLM 0.26 applies it: GLM's FusedMoE scales the routed output instead).
Exits 1 when any launch shape changes a bit, 0 otherwise. Needs vLLM and a GPU; a rule vLLM cannot build prints
its error in its row.
"""

from __future__ import annotations

import argparse
import sys

RULES = {  # name: (groups, topk_groups, biased, scale)
    "glm-4.5 (1 group, bias, x2.5)": (1, 1, True, 2.5),
    "deepseek-v3 (8 groups keep 4, bias, x2.5)": (8, 4, True, 2.5),
    "no bias (8 groups keep 4)": (8, 4, False, 1.0),
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=160)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--rows", type=int, default=4096)
    a = ap.parse_args()
    import torch

    from tic.harness.kernels import routing
    from tic.harness.kernels.routing import Routing

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(a.rows, a.experts, generator=g) * 2).cuda()
    bias = (torch.randn(a.experts, generator=g) * 0.1).cuda()
    varies = False
    print("| rule | launch shape: rows differing (1 / 7 / 64-row launches) | tic's rule: expert sets differing, max "
          "rel weight diff | scale in the router vs after it: max abs diff |")
    print("|---|---|---|---|")
    for name, (groups, keep, biased, scale) in RULES.items():
        try:
            route = vllm_router(a.top_k, a.experts, groups, keep, bias if biased else None, scale)
            w_all, ids_all = route(logits)
            cells = []
            for n in (1, 7, 64):
                parts = [route(chunk) for chunk in logits.split(n)]
                w, ids = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
                rows = (~((w == w_all).all(-1) & (ids == ids_all).all(-1))).sum().item()
                varies |= rows > 0
                cells.append(str(rows))
            rule = Routing("sigmoid", renormalize=True, biased=biased, groups=groups, topk_groups=keep, scale=scale)
            w_tic, ids_tic = routing.route(logits.cpu(), bias.cpu() if biased else None, a.top_k, rule)
            same = (ids_tic.sort(-1).values == ids_all.long().cpu().sort(-1).values).all(-1)
            order = ids_all.long().cpu().argsort(-1)
            w_v = w_all.float().cpu().gather(-1, order)
            w_t = w_tic.gather(-1, ids_tic.argsort(-1))
            rel = ((w_v - w_t).abs() / w_t.abs()).amax(-1)[same].max().item() if same.any() else float("nan")
            unscaled, _ = vllm_router(a.top_k, a.experts, groups, keep, bias if biased else None, 1.0)(logits)
            placement = (w_all.float() - unscaled.float() * scale).abs().max().item()
            print(f"| {name} | {' / '.join(cells)} | {int((~same).sum())} of {a.rows}, {rel:.2e} | {placement:.2e} |")
        except Exception as e:  # one rule vLLM cannot build must not lose the table
            print(f"| {name} | {type(e).__name__}: {str(e)[:120]} | | |")
    return 1 if varies else 0


def vllm_router(top_k, experts, groups, keep, bias, scale):
    """vLLM's router for the rule, as FusedMoE builds it, called on logits [rows, experts]: (weights, ids)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.router.router_factory import create_fused_moe_router

    with set_current_vllm_config(VllmConfig()):
        router = create_fused_moe_router(top_k=top_k, global_num_experts=experts, renormalize=True,
                                         use_grouped_topk=True, num_expert_group=groups, topk_group=keep,
                                         scoring_func="sigmoid", routed_scaling_factor=scale,
                                         e_score_correction_bias=bias)

    def route(logits):
        with set_current_vllm_config(VllmConfig()):
            return router.select_experts(logits.new_zeros(logits.shape[0], 1), logits)

    return route


if __name__ == "__main__":
    sys.exit(main())
