"""C6: training layout invariance. The training forward must give the same logprob bits whatever its own
layout: micro-batch size, padding side, sequence packing, the order in which sequences fill micro-batches."""

from __future__ import annotations

from tic.gates.base import Gate, Judgement, Measurement, Verdict
from tic.harness.measure.layouts import describe_train_layout
from tic.harness.measure.metrics import compare_logprobs, is_exact_match
from tic.core.errors import TicInputError


def measure(ctx) -> Measurement:
    validate(ctx)
    samples = ctx.rollout_samples()
    masks = [s.mask for s in samples]
    reference = ctx.train_logprobs()
    rows, total, equal, first = [], 0, 0, None
    for lay in ctx.cfg.layouts.train:
        changes = lay.changes()
        got = ctx.train_layout_engine(changes).score(samples, ctx.sampling)
        m = compare_logprobs(reference, got, masks)
        rows.append({"layout": describe_train_layout(changes), "equal_fraction": m["equal_fraction"],
                     "exact": is_exact_match(m), "max": m["max"]})
        total += m["tokens"]
        equal += m["equal_tokens"]
        if first is None and m["first_mismatch"]:
            # "rollout"/"train" name the two columns for the locator: reference layout vs this layout
            first = {**m["first_mismatch"], "layout": changes}
    return Measurement(
        metrics={"layouts": len(rows), "identical_layouts": sum(r["exact"] for r in rows),
                 "compared_tokens": total, "equal_tokens": equal,
                 "equal_fraction": equal / total if total else 0.0, "first_mismatch": first},
        details={"reference": {k: getattr(ctx.cfg.train, k) for k in ("micro_batch_size", "padding_side",
                                                                      "packing", "order")},
                 "layouts": rows},
    )


def validate(ctx) -> None:
    """Each layout must differ from the configured train layout: comparing a layout with itself proves nothing."""
    ctx.require_live("train", "C6")
    ref = ctx.cfg.train
    for i, lay in enumerate(ctx.cfg.layouts.train):
        changes = lay.changes()
        if all(getattr(ref, k) == v for k, v in changes.items()):
            raise TicInputError(f"layouts.train[{i}] ({describe_train_layout(changes)}) is the configured train "
                                "layout itself; C6 would compare it with itself")


def judge(m: Measurement) -> Judgement:
    x = m.metrics
    key = f"{100 * x['equal_fraction']:.1f}% tokens equal, {x['identical_layouts']}/{x['layouts']} layouts identical"
    if x["layouts"] > 0 and x["identical_layouts"] == x["layouts"] and x["equal_tokens"] == x["compared_tokens"]:
        return Judgement(Verdict.PASS, "every training layout reproduces the reference layout bit for bit", key)
    f = x["first_mismatch"] or {}
    return Judgement(Verdict.FAIL, f"layout {describe_train_layout(f.get('layout', {}))} differs first at sequence "
                                   f"{f.get('sequence')}, position {f.get('position')}: {f.get('rollout')!r} vs "
                                   f"{f.get('train')!r} ({f.get('ulps')} ulp)", key)


GATE = Gate(
    id="C6", title="Training layout invariance", step=3,
    measures="training logprobs of the rollout's sequences under each layout in layouts.train (micro-batch size, "
             "padding side, packing, sequence order) vs the configured train layout, bit for bit",
    pass_condition="every layout's logprobs are bitwise equal to the reference layout's (100% equal tokens)",
    inputs=["train engine (live)", "rollout samples", "layouts.train"], artifacts=[], guide="guides/C6.md",
    measure=measure, judge=judge, locate_on_fail=True, reads=("rollout", "train", "prompts", "layouts"),
    validate=validate)
