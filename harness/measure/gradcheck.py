"""C7's measurement: per-parameter gradients of the training path vs an independent reference.

The loss is fixed and policy-gradient-like: L = -(1/N) sum_i A_i sum_t logp(i, t) over the rollout's valid
response tokens, with advantages A_i drawn from a seeded generator and centred (a function of the request
index alone). The path under test computes it through the train engine (tic's kernel wrappers, its layout).
The reference is plain transformers in float32 on the same weights, one sequence per forward, with torch's
log_softmax (for a block-FP8 model its quantized modules give the FP8 forward's values: fp8_reference): no tic
kernel or backward on its path, but one discrete decision: in a mixture-of-experts model its routers
take the top-k expert ids the path under test chose (their weights still float32 softmax of the reference's own
logits). Without it a token near a routing tie picks other experts in float32 and sends its gradient to them,
which is not a fault of the backward; the count of such tokens is reported.
"""

from __future__ import annotations

import contextlib
import inspect
from pathlib import Path
from typing import Callable

import torch

from tic.harness.engines.base import Sample, Sampling
from tic.harness.kernels import routing
from tic.harness.kernels.routing import Routing


def advantages(n: int, seed: int = 0) -> list[float]:
    a = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (a - a.mean()).tolist() if n > 1 else a.tolist()


class RoutingPin:
    """Makes each HF top-k router (a `gate` or `router` module returning (logits, top-k weights, top-k ids)) take
    given ids: where they are the experts it chose itself, its own weights in the given slot order; where they are
    not, its float32 softmax at those ids, renormalised as the router does. Counts the tokens whose own float32
    top-k set differed (routing flips). near_tie: take a token's given ids only where each is within that
    relative distance of the router's own k-th probability (a near tie), else its own ids (the fidelity check:
    a router that picks other experts outright must still show)."""

    def __init__(self, model, near_tie: float | None = None):
        from tic.harness.kernels import coverage

        blocks = {name: m for name, m in model.named_modules() if coverage.moe_router(m) is not None}
        self.gates = {name: coverage.moe_router(m) for name, m in blocks.items()}
        cfg = getattr(model, "config", None)
        # an unread router (only where a test bypasses C0's refusal) is pinned as a softmax top-k, kept as it is
        self.routing = {id(self.gates[n]): coverage.router_routing(self.gates[n], cfg, coverage.handed_bias(m))
                        or Routing(renormalize=False) for n, m in blocks.items()}
        self.bias = {id(self.gates[n]): coverage.block_routing_bias(m) for n, m in blocks.items()}
        self.near_tie = near_tie
        self.flips = 0
        self.tokens = 0
        self.unpinned: set[str] = set()

    @contextlib.contextmanager
    def pinned(self, routes: dict[str, torch.Tensor]):
        saved = {}
        for block, gate in self.gates.items():
            ids = routes.get(block)
            if ids is None:
                self.unpinned.add(block)
                continue
            saved[block] = gate.forward
            gate.forward = self._forward(gate, gate.forward, ids)
        try:
            yield
        finally:
            for block, fwd in saved.items():
                self.gates[block].forward = fwd

    def _forward(self, gate, original, ids):
        def forward(hidden_states, *args, **kwargs):  # a router the block hands its bias takes it along
            out = original(hidden_states, *args, **kwargs)
            if not (isinstance(out, tuple) and len(out) == 3) or out[2].shape != ids.shape:
                raise ValueError(f"router output {type(out).__name__} does not take pinned top-k ids of shape "
                                 f"{tuple(ids.shape)}")
            logits, _, own = out
            pin = ids.to(device=own.device, dtype=own.dtype)
            rule, bias = self.routing[id(gate)], self.bias[id(gate)]
            probs = routing.scores(logits.float(), rule)
            if self.near_tie is not None and rule.plain:  # its own are the top k: the others score below
                kth = probs.gather(-1, own).min(-1, keepdim=True).values
                tie = (probs.gather(-1, pin) >= kth * (1 - self.near_tie)).all(-1, keepdim=True)
                pin = torch.where(tie, pin, own)
            elif self.near_tie is not None:
                pin = torch.where(_rule_picks_within(probs, logits, bias, rule, pin, self.near_tie), pin, own)
            moved = (own.sort(-1).values != pin.sort(-1).values).any(-1, keepdim=True)
            self.flips += int(moved.sum())
            self.tokens += pin.shape[0]
            w = routing.weights(probs, pin, rule)
            # where the router chose these experts itself, its own weights (in the pinned slot order): the rule
            # above stands in only for the tokens it moved, so a router of another rule still parts
            same = (pin[..., :, None] == own[..., None, :]).to(out[1].dtype)
            kept = (same * out[1][..., None, :]).sum(-1)
            return logits, torch.where(moved, w.to(logits.dtype), kept.to(logits.dtype)), pin
        return forward


def _rule_picks_within(probs, logits, bias, rule, given: torch.Tensor, near_tie: float) -> torch.Tensor:
    """[T, 1]: whether the rule itself picks each row's given experts once every selection value moves by at most
    near_tie of itself, the given experts' up and all others' down. A grouped rule decides twice (its groups, then
    experts within them), so a near tie between two groups' scores swaps experts whose own scores are far apart:
    comparing the two choices expert by expert would call that an outright different choice."""
    c = routing.choice(probs, logits, bias, rule)
    moved = torch.zeros_like(c, dtype=torch.bool).scatter_(-1, given, True)
    c = torch.where(moved, c + near_tie * c.abs(), c - near_tie * c.abs())
    picked = routing.select(c, given.shape[-1], rule)
    return (picked.sort(-1).values == given.sort(-1).values).all(-1, keepdim=True)


def takes_logits_to_keep(model) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def response_logits(model, ids: torch.Tensor, P: int, R: int, keep_only: bool) -> torch.Tensor:
    """The logits that predict the R response tokens of one row (P prompt tokens). Where the model can, its head
    runs on those rows alone: a long prompt's logits and their gradient are vocabulary-wide rows for every prompt
    position (GiBs at 4k tokens and 150k words) that the loss never reads."""
    if keep_only:
        return model(input_ids=ids, use_cache=False, logits_to_keep=R + 1).logits[0, :R]
    return model(input_ids=ids, use_cache=False).logits[0, P - 1:P - 1 + R]


def reference_gradients(model_dir: Path, samples: list[Sample], sampling: Sampling, adv: list[float],
                        device: str = "cpu", routes: list[dict] | None = None,
                        report: dict | None = None, kv_cache_dtype: str = "auto",
                        quantizer_inputs: Callable[[int], dict] | None = None,
                        fp8_rules: dict | None = None, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """dtype: the reference model's (C7's low-precision yardstick runs the stock model in the training dtype).
    routes: per sample, the path under test's top-k ids per MoE block name (None: the reference routes
    itself); report receives the routing-pin and quantizer counts; kv_cache_dtype: the training side's (fp8: the
    reference's attention reads q, k, v rounded as the FP8 cache rounds them); quantizer_inputs: sample index ->
    what the path under test's FP8 steps rounded (fp8_reference.QuantizerInputs); fp8_rules: how the path's FP8
    steps round (tic.harness.kernels.fp8_rule: its block-FP8 linears' and experts' scales, its attention over an
    FP8 KV cache; the reference rounds alike)."""
    from transformers import AutoModelForCausalLM

    from tic.harness.kernels.fp8 import unquantized_config
    from tic.harness.measure import fp8_reference, ssd_reference
    from tic.harness.measure.lean_attention import use_lean_attention
    from tic.harness.model.layer_structure import quiet_transformers

    fp8 = unquantized_config(model_dir)
    with quiet_transformers() if fp8 else contextlib.nullcontext():  # no load report for a checkpoint's scales
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager", **fp8)
    model.to(device).train(False)
    rounds = fp8 or str(kv_cache_dtype).startswith("fp8")  # FP8 weights or an FP8 KV cache
    taken = fp8_reference.QuantizerInputs() if rounds and quantizer_inputs is not None else None
    # FP8: its values, the float32 graph's gradient
    fp8_reference.follow_deployment(model, model_dir, kv_cache_dtype, taken, fp8_rules)
    recomputed = use_lean_attention(model)  # long rows: one layer's attention scores at a time, not every layer's
    model.requires_grad_(True)
    pin = RoutingPin(model)
    keep_only = takes_logits_to_keep(model)
    n_tokens = sum(int(s.mask.sum()) if s.mask is not None else len(s.response_ids) for s in samples)
    # Mamba-2 mixers: transformers' torch scan, as einsums (some releases hold a positions^2 x state product)
    with ssd_reference.lean_scans(model) as switched:
        for i, (s, a) in enumerate(zip(samples, adv)):
            P, R = len(s.prompt_ids), len(s.response_ids)
            ids = torch.tensor([s.ids], device=device)
            ctx = pin.pinned(routes[i]) if routes and pin.gates else contextlib.nullcontext()
            if taken is not None:
                taken.current = quantizer_inputs(i)
            with ctx:
                logits = response_logits(model, ids, P, R, keep_only=keep_only).float()
            if sampling.temperature not in (0, 1):
                logits = logits / sampling.temperature
            picked = torch.tensor(s.response_ids, device=device)
            lp = torch.log_softmax(logits, dim=-1)[torch.arange(R, device=device), picked]
            if s.mask is not None:
                lp = lp * s.mask.to(device=device, dtype=lp.dtype)
            (-a * lp.sum() / max(n_tokens, 1)).backward()
    if report is not None and switched:
        report["mamba2_scans_as_einsums"] = switched
    if report is not None and recomputed:
        report["attention_scores_recomputed_in_backward"] = recomputed
    if report is not None and pin.gates:
        report.update({"moe_routers": len(pin.gates), "pinned": bool(routes), "routed_tokens": pin.tokens,
                       "reference_would_flip": pin.flips, "unpinned": sorted(pin.unpinned)})
    if report is not None and taken is not None:
        report.update(taken.counts("path_under_tests"))
    if report is not None and fp8_rules:
        report["fp8_rules"] = fp8_reference.describe_rules(fp8_rules)
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().cpu()
            for n, p in model.named_parameters()}


def compare(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> list[dict]:
    """Per tensor: cosine similarity and relative error ||g - g_ref|| / ||g_ref|| (float64). A tensor whose
    reference gradient is zero passes only if its gradient is zero too (cosine 1, error 0; else inf)."""
    rows = []
    for name, r in ref.items():
        g = grads.get(name)
        if g is None or g.shape != r.shape:
            rows.append({"parameter": name, "cosine": float("nan"), "rel_error": float("inf"),
                         "problem": "missing" if g is None else f"shape {tuple(g.shape)} vs {tuple(r.shape)}"})
            continue
        g64, r64 = g.double().flatten(), r.double().flatten()
        rn, gn, dn = r64.norm().item(), g64.norm().item(), (g64 - r64).norm().item()
        if not (torch.isfinite(g64).all() and torch.isfinite(r64).all()):
            cos, rel = float("nan"), float("inf")
        elif rn == 0:
            cos, rel = (1.0, 0.0) if gn == 0 else (0.0, float("inf"))
        else:
            cos = (g64 @ r64).item() / (gn * rn) if gn > 0 else 0.0
            rel = dn / rn
        rows.append({"parameter": name, "cosine": cos, "rel_error": rel, "ref_norm": rn, "norm": gn})
    return rows
