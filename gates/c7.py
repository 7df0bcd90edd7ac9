"""C7: backward vs an independent reference. The training path's forward values come from inference kernels
and its backward is a surrogate (autograd wrappers, straight-through); this gate checks that surrogate's
gradients per parameter tensor against plain transformers in float32 on the same weights and tokens."""

from __future__ import annotations

import json
import math

import torch

from tic.core.errors import TicInputError
from tic.core.fsio import atomic_write_text
from tic.gates.base import Gate, Judgement, Measurement, Verdict
from tic.harness.kernels.fp8 import unquantized_config
from tic.harness.measure.gradcheck import advantages, compare, reference_gradients
from tic.harness.kernels.autograd import StaleWeightError

# (min cosine, max relative error) by the training model's dtype, unless tic.yaml's gradients: sets them
DEFAULT_THRESHOLDS = {"float32": (0.999, 1e-2), "low": (0.99, 0.1)}
# with the low-precision defaults, a tensor may be as far from the float32 reference as this many times the stock
# model's own gradient in the training dtype is: a model whose bf16 forward parts from its float32 one (sharp
# attention over random weights) has bf16 gradients no backward, plain autograd included, brings closer
STOCK_YARDSTICK_FACTOR = 1.5


def _finite(x):
    return x if isinstance(x, float) and math.isfinite(x) else None


def model_dtype(ctx) -> str:
    dtype = ctx.model.dtype
    if dtype == "auto":
        c = ctx.model.config
        dtype = str(c.get("dtype") or c.get("torch_dtype") or "float32")
    return dtype


def thresholds(ctx) -> tuple[float, float]:
    cos, rel = DEFAULT_THRESHOLDS["float32" if model_dtype(ctx) == "float32" else "low"]
    g = ctx.cfg.gradients
    return (g.min_cosine if g.min_cosine is not None else cos,
            g.max_rel_error if g.max_rel_error is not None else rel)


def measure(ctx) -> Measurement:
    tc = ctx.cfg.train
    if tc.engine not in ("hf", "megatron") or tc.kernels not in ("consistent", "vllm"):
        if tc.engine == "dump":
            raise TicInputError("C7 needs a live train engine (hf with kernels consistent or vllm), not a dump")
        # stock kernels train with plain autograd: there is no surrogate to check, and nothing to pass
        return Measurement(metrics={"tensors": 0}, details={
            "error": None, "tensors": [], "min_cosine": None, "max_rel_error": None,
            "not_checked": f"train.kernels is {tc.kernels}: C7 checks the surrogate backward of tic's kernel "
                           "wrappers (train: {engine: hf, kernels: consistent or vllm})"})
    samples = ctx.rollout_samples()
    adv = advantages(len(samples), ctx.cfg.gradients.advantage_seed)
    min_cos, max_rel = thresholds(ctx)
    details = {"min_cosine": min_cos, "max_rel_error": max_rel, "train_kernels": tc.kernels,
               "reference": "transformers, float32, eager attention, one sequence per forward (MoE routers take "
                            "the top-k experts the path under test chose; block-FP8 quantizers the activations it "
                            "quantized)",
               "loss": "-(1/N) sum_i A_i sum_t logp(i, t), A_i seeded normal, centred", "error": None}
    try:
        grads = ctx.train_engine().policy_gradients(samples, ctx.sampling, adv)
    except StaleWeightError as e:
        details["error"] = f"stale weight version: {e}"
        return Measurement(metrics={"tensors": 0, "failing": 0}, details={**details, "tensors": []})
    engine = ctx.train_engine()
    routes = [engine.expert_routes(s) for s in samples]
    routing: dict = {}
    own_inputs = getattr(engine, "quantizer_inputs", None)  # FP8: what the path under test rounded
    rules = engine.fp8_rules() if hasattr(engine, "fp8_rules") else {}  # FP8: the deployment's rounding rules
    ref = reference_gradients(ctx.model.dir, samples, ctx.sampling, adv, device=tc.device,
                              routes=routes if any(routes) else None, report=routing,
                              kv_cache_dtype=str(tc.options.get("kv_cache_dtype", "auto")),
                              quantizer_inputs=(lambda i: own_inputs(samples[i])) if own_inputs else None,
                              fp8_rules=rules)
    if routing:
        details["routing"] = routing
    rows = compare(grads, ref)
    g = ctx.cfg.gradients
    kv = str(tc.options.get("kv_cache_dtype", "auto"))
    fp8 = bool(rules) or kv.startswith("fp8") or bool(unquantized_config(ctx.model.dir))  # its own reference rule
    if model_dtype(ctx) != "float32" and g.min_cosine is None and g.max_rel_error is None and not fp8 \
            and any(_outside(r, min_cos, max_rel) for r in rows):
        # the stock model in the training dtype, same tokens, routes and loss: how far its own gradients are
        stock = reference_gradients(ctx.model.dir, samples, ctx.sampling, adv, device=tc.device,
                                    routes=routes if any(routes) else None,
                                    dtype=getattr(torch, model_dtype(ctx)))
        rows = with_stock_yardstick(rows, compare(stock, ref), min_cos, max_rel)
        details["stock_yardstick"] = {"dtype": model_dtype(ctx), "factor": STOCK_YARDSTICK_FACTOR,
                                      "relaxed": sum("stock_cosine" in r and (r["min_cosine"] < min_cos or
                                                     r["max_rel_error"] > max_rel) for r in rows)}
    rows = [{**r, "cosine": _finite(r["cosine"]), "rel_error": _finite(r["rel_error"])} for r in rows]
    path = ctx.artifacts("C7") / "gradients.json"
    atomic_write_text(path, json.dumps({**details, "tensors": rows}, indent=2))
    cos = [r["cosine"] for r in rows if r["cosine"] is not None]
    rel = [r["rel_error"] for r in rows if r["rel_error"] is not None]
    return Measurement(
        metrics={"tensors": len(rows), "min_cosine": min(cos) if cos else None,
                 "max_rel_error": max(rel) if rel else None,
                 "non_finite": sum(r["cosine"] is None or r["rel_error"] is None for r in rows)},
        details={**details, "tensors": rows},
        evidence=[str(path)],
    )


def _outside(row: dict, lo: float, hi: float) -> bool:
    cos, rel = row["cosine"], row["rel_error"]
    return not (math.isfinite(cos) and math.isfinite(rel) and cos >= lo and rel <= hi)


def with_stock_yardstick(rows: list[dict], stock_rows: list[dict], lo: float, hi: float) -> list[dict]:
    """Each tensor's bounds widened to STOCK_YARDSTICK_FACTOR times the stock low-precision model's own distance
    from the float32 reference where that is wider than the defaults (never narrowed; a non-finite stock
    gradient widens nothing)."""
    stock = {r["parameter"]: r for r in stock_rows}
    out = []
    for r in rows:
        s = stock.get(r["parameter"])
        if s is None or not (math.isfinite(s["cosine"]) and math.isfinite(s["rel_error"])):
            out.append(r)
            continue
        out.append({**r, "stock_cosine": s["cosine"], "stock_rel_error": s["rel_error"],
                    "min_cosine": min(lo, 1 - STOCK_YARDSTICK_FACTOR * (1 - s["cosine"])),
                    "max_rel_error": max(hi, STOCK_YARDSTICK_FACTOR * s["rel_error"])})
    return out


def judge(m: Measurement) -> Judgement:
    x, d = m.metrics, m.details
    if d["error"]:
        return Judgement(Verdict.FAIL, f"backward raised: {d['error']}", "no gradients")
    if d.get("not_checked"):
        return Judgement(Verdict.FAIL, d["not_checked"], "no gradients")
    lo, hi = d["min_cosine"], d["max_rel_error"]
    bad = [r for r in d["tensors"] if r["cosine"] is None or r["rel_error"] is None
           or r["cosine"] < r.get("min_cosine", lo) or r["rel_error"] > r.get("max_rel_error", hi)]
    fmt = lambda v, spec: "non-finite" if v is None else format(v, spec)  # noqa: E731
    key = (f"{len(d['tensors']) - len(bad)}/{len(d['tensors'])} tensors within cosine >= {lo}, rel err <= {hi}; "
           f"min cosine {fmt(x['min_cosine'], '.9f')}, max rel err {fmt(x['max_rel_error'], '.3g')}")
    yard = d.get("stock_yardstick")
    if yard and yard["relaxed"]:
        key += (f"; {yard['relaxed']} tensors' bounds widened to {yard['factor']}x the stock {yard['dtype']} "
                "model's own distance from the reference")
    if d["tensors"] and not bad:
        return Judgement(Verdict.PASS, "every parameter's gradient is within the stated tolerance of the float32 "
                                       "reference", key)
    if not d["tensors"]:
        return Judgement(Verdict.FAIL, "no parameter gradient was compared", key)
    w = max(bad, key=lambda r: math.inf if r["rel_error"] is None else r["rel_error"])
    return Judgement(Verdict.FAIL, f"{len(bad)} of {len(d['tensors'])} parameter gradients outside the tolerance; "
                                   f"worst {w['parameter']}: cosine {w['cosine']}, rel err {w['rel_error']}", key)


GATE = Gate(
    id="C7", title="Backward vs independent reference", step=3,
    measures="per-parameter gradients of a fixed policy-gradient loss on the rollout's tokens through the train "
             "engine's kernel wrappers vs plain transformers in float32 on the same weights (MoE routers pinned to "
             "the experts the path under test chose): cosine similarity "
             "and relative error ||g - g_ref|| / ||g_ref|| per tensor",
    pass_condition="every parameter tensor has cosine >= min_cosine and relative error <= max_rel_error (defaults: "
                   "float32 0.999 and 1e-2; bf16/fp16 0.99 and 0.1, each tensor's widened to 1.5x the stock bf16/fp16 "
                   "model's own distance from the reference where that is wider; tic.yaml gradients: overrides, "
                   "then nothing is widened), gradients "
                   "finite, and no backward saw its weights change since its forward (the only gate with a "
                   "tolerance)",
    inputs=["train engine (hf, kernels consistent or vllm)", "rollout samples", "gradients (thresholds)"],
    artifacts=["artifacts/C7/gradients.json"], guide="guides/C7.md", measure=measure, judge=judge,
    reads=("rollout", "train", "prompts"), validate=lambda ctx: ctx.require_live("train", "C7"))
