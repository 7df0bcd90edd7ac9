"""C3: batch independence in inference. A request sampled alone must come out bitwise identical inside
batches of several sizes and at several positions."""

from __future__ import annotations

from tic.gates.base import Gate, Judgement, Measurement, Verdict
from tic.harness.measure.layouts import probe_batch
from tic.harness.measure.metrics import compare_generation
from tic.core.errors import TicInputError


def measure(ctx) -> Measurement:
    eng = ctx.live_rollout_engine("C3")
    prompts, sp, lay = ctx.prompts, ctx.sampling, ctx.cfg.layouts
    probes = list(range(min(lay.probes, len(prompts))))
    rows, compared, equal, identical, first = [], 0, 0, 0, None
    for p in probes:
        alone = eng.generate_together([prompts[p]], sp, [p])[0]
        for size in lay.batch_sizes:
            for position in lay.positions:
                batch_prompts, batch_ids, at = probe_batch(prompts, p, size, position)
                got = eng.generate_together(batch_prompts, sp, batch_ids)[at]
                c = compare_generation(alone, got)
                layout = f"probe {p}, batch {size}, {position}"
                rows.append({"layout": layout, **{k: c[k] for k in ("compared", "equal", "identical",
                                                                     "token_divergence")}})
                compared += c["compared"]
                equal += c["equal"]
                identical += int(c["identical"])
                if first is None and c["first_mismatch"]:
                    first = {"layout": layout, "probe": p, "batch_size": size, "index_in_batch": at,
                             **c["first_mismatch"]}
    if not rows:
        raise TicInputError("C3 has nothing to compare (no probe, batch size or position)")
    return Measurement(
        metrics={"comparisons": len(rows), "identical_requests": identical, "compared_tokens": compared,
                 "equal_tokens": equal, "equal_fraction": equal / compared if compared else 0.0,
                 "first_mismatch": first},
        details={"layouts": rows},
    )


def judge(m: Measurement) -> Judgement:
    x = m.metrics
    key = f"{100 * x['equal_fraction']:.1f}% tokens equal, {x['identical_requests']}/{x['comparisons']} identical"
    if x["comparisons"] > 0 and x["identical_requests"] == x["comparisons"] and x["equal_tokens"] == x["compared_tokens"]:
        return Judgement(Verdict.PASS, "every probe is bitwise identical alone and in every batch layout", key)
    f = x["first_mismatch"] or {}
    return Judgement(Verdict.FAIL, f"first difference: {f.get('layout')}, response position {f.get('position')}: "
                                   f"alone {f.get('alone')!r} vs batched {f.get('batched')!r} "
                                   f"({f.get('ulps')} ulp)", key)


GATE = Gate(
    id="C3", title="Alone vs batch (inference)", step=2,
    measures="each probe request sampled alone, then inside batches of each configured size at each position; "
             "sampled tokens and their logprobs compared bit for bit",
    pass_condition="every probe's tokens and logprobs are bitwise identical in every layout (100% equal)",
    inputs=["rollout engine (live)", "prompts", "sampling", "layouts"], artifacts=[], guide="guides/C3.md",
    measure=measure, judge=judge, locate_on_fail=True, reads=("rollout", "prompts", "layouts"),
    validate=lambda ctx: ctx.require_live("rollout", "C3"))
