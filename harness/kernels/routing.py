"""What a MoE router computes from its logits, as a typed spec: `Routing`, read from the router's own forward by
tic.harness.kernels.coverage (`router_routing`), computed by the providers (`moe_route`) and by the float32
reference here.

Two families run through it:
  - softmax routers (Qwen-MoE, Mixtral, Jamba): top-k of softmax(logits), weights renormalised or not;
  - score routers in the DeepSeek-V3 way (GLM-4.5, MiniMax-M2, HunYuan): sigmoid scores; a selection bias added
    to the scores (or, Kolibri's, to the logits) only to choose the experts; experts split in groups, of which
    each token keeps the best
    `topk_groups` (a group's score: the sum of its two best biased scores, or its best score without a bias);
    the weights are the chosen experts' unbiased scores, renormalised or not, times `scale`
    (routed_scaling_factor).
Ties go to the lower expert (or group) id, by a stable descending sort, so a choice never depends on a sort
kernel's tie rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCORES = ("softmax", "sigmoid")


@dataclass(frozen=True)
class Routing:
    score: str = "softmax"  # SCORES
    renormalize: bool = True  # the chosen weights scaled to sum to one
    biased: bool = False  # a per-expert selection bias (e_score_correction_bias) joins the scores to choose
    groups: int = 1  # expert groups (n_group); 1: no grouping
    topk_groups: int = 1  # groups each token keeps (topk_group)
    scale: float = 1.0  # routed_scaling_factor, on the weights
    on_logits: bool = False  # the experts are chosen on the logits (plus the bias), not on the scores (Kolibri)

    @property
    def plain(self) -> bool:
        """A softmax top-k router: the operator every provider has run since the first MoE."""
        return self.score == "softmax" and not self.biased and self.groups == 1 and self.scale == 1.0 \
            and not self.on_logits

    def describe(self) -> str:
        parts = [self.score, "renormalised" if self.renormalize else "not renormalised"]
        if self.biased:
            parts.append("selection bias" + (" on the logits" if self.on_logits else ""))
        elif self.on_logits:
            parts.append("chosen on the logits")
        if self.groups > 1:
            parts.append(f"{self.topk_groups} of {self.groups} groups")
        if self.scale != 1.0:
            parts.append(f"x {self.scale:g}")
        return ", ".join(parts)


def as_routing(rule) -> Routing:
    """A Routing, or the renormalise flag of a softmax router (the callers that predate the spec)."""
    return rule if isinstance(rule, Routing) else Routing(renormalize=bool(rule))


def scores(logits: torch.Tensor, routing: Routing) -> torch.Tensor:
    """softmax or sigmoid of the logits in float32 (float64 stays float64)."""
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.softmax(wide, dim=-1) if routing.score == "softmax" else torch.sigmoid(wide)


def _descending(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of each row, ties to the lower index."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def choice(s: torch.Tensor, logits: torch.Tensor, bias: torch.Tensor | None, routing: Routing) -> torch.Tensor:
    """What the experts are chosen on: the scores s (or the logits), plus the selection bias where there is one."""
    base = logits.to(s.dtype) if routing.on_logits else s
    return base + bias.to(s.dtype) if routing.biased and bias is not None else base


def select(c: torch.Tensor, top_k: int, routing: Routing) -> torch.Tensor:
    """The chosen experts' ids [T, k] from what they are chosen on (`choice`) [T, E], in descending order."""
    if routing.groups > 1:
        T, E = c.shape
        per = c.reshape(T, routing.groups, E // routing.groups)
        if routing.biased:
            best = torch.sort(per, dim=-1, descending=True, stable=True).values[..., :2].sum(-1)
        else:
            best = per.max(dim=-1).values
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(-1, _descending(best, routing.topk_groups), True)
        c = c.masked_fill(~keep.repeat_interleave(E // routing.groups, dim=-1), float("-inf"))
    return _descending(c, top_k)


def weights(s: torch.Tensor, ids: torch.Tensor, routing: Routing) -> torch.Tensor:
    """The chosen experts' weights: their unbiased scores, renormalised as the routing says, times its scale."""
    w = s.gather(-1, ids)
    if routing.renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w * routing.scale if routing.scale != 1.0 else w


def route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, routing: Routing):
    """(weights float32 [T, k], ids int64 [T, k]) for logits [T, E]: the whole rule on the rows given."""
    s = scores(logits, routing)
    ids = select(choice(s, logits, bias, routing), top_k, routing)
    return weights(s, ids, routing).to(torch.float32), ids


def weights_backward(logits: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor, routing: Routing) -> torch.Tensor:
    """d loss / d logits for weights(scores(logits), ids) with the ids fixed (the choice and its bias take no
    gradient), in float32 or wider."""
    s = scores(logits, routing)
    g = grad.to(s.dtype) * routing.scale
    if routing.renormalize:
        w = s.gather(-1, ids)
        total = w.sum(-1, keepdim=True)
        g = (g - (g * w).sum(-1, keepdim=True) / total) / total
    gs = torch.zeros_like(s).scatter_add_(-1, ids, g)
    if routing.score == "softmax":
        return s * (gs - (s * gs).sum(-1, keepdim=True))
    return gs * s * (1 - s)
