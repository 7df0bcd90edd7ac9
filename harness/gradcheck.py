"""C7's measurement: per-parameter gradients of the training path vs an independent reference.

The loss is fixed and policy-gradient-like: L = -(1/N) sum_i A_i sum_t logp(i, t) over the rollout's valid
response tokens, with advantages A_i drawn from a seeded generator and centred (a function of the request
index alone). The path under test computes it through the train engine (tic's kernel wrappers, its layout).
The reference is plain transformers in float32 on the same weights, one sequence per forward, with torch's
log_softmax: no tic code on its path.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tic.harness.engines.base import Sample, Sampling


def advantages(n: int, seed: int = 0) -> list[float]:
    a = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (a - a.mean()).tolist() if n > 1 else a.tolist()


def reference_gradients(model_dir: Path, samples: list[Sample], sampling: Sampling, adv: list[float],
                        device: str = "cpu") -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.to(device).train(False)
    model.requires_grad_(True)
    n_tokens = sum(int(s.mask.sum()) if s.mask is not None else len(s.response_ids) for s in samples)
    for s, a in zip(samples, adv):
        P, R = len(s.prompt_ids), len(s.response_ids)
        ids = torch.tensor([s.ids], device=device)
        logits = model(input_ids=ids, use_cache=False).logits[0, P - 1:P - 1 + R].float()
        if sampling.temperature not in (0, 1):
            logits = logits / sampling.temperature
        lp = torch.log_softmax(logits, dim=-1)[torch.arange(R, device=device), torch.tensor(s.response_ids,
                                                                                               device=device)]
        if s.mask is not None:
            lp = lp * s.mask.to(device=device, dtype=lp.dtype)
        (-a * lp.sum() / max(n_tokens, 1)).backward()
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
