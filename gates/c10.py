"""C10: performance against the frozen baseline. Baseline and consistent rollout run in one process on the
same workload, alternating, repeated; the ratio of their throughputs is judged against perf.floor, with C5's
diff re-measured on the consistent rollout in the same run. Refused when anything but the consistency switch
differs between the two sides, or between the baseline now and the frozen one."""

from __future__ import annotations

import json

from tic.gates.base import Gate, Judgement, Measurement, Verdict
from tic.core.fsio import atomic_write_text
from tic.gates.c1 import perf_side
from tic.harness.measure.baseline import baseline_dir, verify
from tic.harness.measure.fingerprint import differences
from tic.harness.measure.metrics import is_exact_match, summary
from tic.harness.measure.perf import (Workload, measure_sides, pass_summary, side_fingerprint, spread,
                                      switch_allowance)
from tic.harness.measure.rl import rollout_and_recompute


def measure(ctx) -> Measurement:
    p = ctx.cfg.perf
    st = verify(baseline_dir(ctx.cfg))
    if not st.valid:
        return Measurement(metrics={"refused": True, "waiting": st.waiting},
                           details={"refused": "C1 baseline not valid: " + "; ".join(st.all_problems)})
    frozen = st.record
    wl = Workload(**frozen["workload"])
    base, base_env = perf_side(ctx, "baseline")
    cons, cons_env = perf_side(ctx, "consistent")
    # through JSON, as the frozen one was stored
    fp_base = json.loads(json.dumps(side_fingerprint(base, base_env, wl, ctx.model_hash)))
    fp_cons = json.loads(json.dumps(side_fingerprint(cons, cons_env, wl, ctx.model_hash)))
    pair = differences(fp_base, fp_cons, switch_allowance(cons) | switch_allowance(base))
    since = differences(frozen.get("fingerprint", {}), fp_base)
    details = {"fingerprint_baseline": fp_base, "fingerprint_consistent": fp_cons, "baseline_hash": st.hash}
    if pair or since:
        why = (["baseline vs consistent differ beyond the consistency switch: " + "; ".join(pair[:4])] if pair else [])
        why += (["the baseline differs from the frozen one: " + "; ".join(since[:4])] if since else [])
        return Measurement(metrics={"refused": True}, details={**details, "refused": " / ".join(why),
                                                               "differences": pair, "since_frozen": since})
    passes = measure_sides({"baseline": (base, base_env), "consistent": (cons, cons_env)}, wl, ctx.vocab_size,
                           p.warmup, p.repeats)
    tp = {s: [x["throughput_tok_s"] for x in passes if x["side"] == s] for s in ("baseline", "consistent")}
    ratios = [c / b for b, c in zip(tp["baseline"], tp["consistent"]) if b > 0]
    _, _, c5 = rollout_and_recompute(cons, ctx.train_engine(), ctx.prompts, ctx.sampling, 0)
    out = ctx.artifacts("C10")
    atomic_write_text(out / "requests.jsonl", "".join(json.dumps(r) + "\n" for x in passes for r in x["requests"]))
    result = {"passes": [pass_summary(x) for x in passes], "ratio": spread(ratios), "ratios": ratios,
              "baseline_tok_s": spread(tp["baseline"]), "consistent_tok_s": spread(tp["consistent"]),
              "frozen_baseline_tok_s": frozen.get("throughput_tok_s", {}), "floor": p.floor,
              "c5": {"exact": is_exact_match(c5), "diff": summary(c5)}}
    atomic_write_text(out / "summary.json", json.dumps(result, indent=2))
    frozen_med = frozen.get("throughput_tok_s", {}).get("median")
    return Measurement(
        metrics={"refused": False, "ratio_median": spread(ratios)["median"], "ratio_min": min(ratios),
                 "ratio_max": max(ratios), "ratio_iqr": spread(ratios)["iqr"], "pairs": len(ratios),
                 "floor": p.floor, "c5_exact": is_exact_match(c5),
                 "baseline_vs_frozen": (spread(tp["baseline"])["median"] / frozen_med) if frozen_med else None},
        details={**details, **result},
        evidence=[str(out / "requests.jsonl"), str(out / "summary.json")],
    )


def judge(m: Measurement) -> Judgement:
    x, d = m.metrics, m.details
    if x.get("waiting"):
        return Judgement(Verdict.WAITING, f"waiting for C1: {d['refused']}", "no comparison")
    if x["refused"]:
        return Judgement(Verdict.FAIL, f"refused: {d['refused']}", "no comparison")
    key = (f"ratio {x['ratio_median']:.3f} (min {x['ratio_min']:.3f}, max {x['ratio_max']:.3f}, "
           f"{x['pairs']} pairs), floor {x['floor']}")
    if not x["c5_exact"]:
        return Judgement(Verdict.FAIL, f"C5 re-measured in this run is not diff = 0 ({d['c5']['diff']}): speed of an "
                                       "inconsistent rollout does not count", key)
    if x["ratio_median"] >= x["floor"]:
        return Judgement(Verdict.PASS, "consistent rollout at or above the floor of the frozen baseline's throughput, "
                                       "diff = 0 in the same run", key)
    return Judgement(Verdict.FAIL, f"median throughput ratio {x['ratio_median']:.3f} below the floor {x['floor']}", key)


GATE = Gate(
    id="C10", title="Performance vs the frozen baseline", step=5,
    measures="throughput (generated tokens / wall second) of the baseline and the consistent rollout on the frozen "
             "workload, in one run, alternating, perf.repeats passes each after perf.warmup; their ratio per pair "
             "(median, min, max, IQR); C5's diff on a fresh consistent rollout in the same run",
    pass_condition="C1's baseline is valid (frozen, approved, unchanged); the two sides' fingerprints (environment, "
                   "env vars, packages, patches, engine settings, model, workload) differ only in the consistency "
                   "switch and the baseline side equals the frozen fingerprint (else refused); diff = 0 in the same "
                   "run; median consistent/baseline throughput ratio >= perf.floor (default 0.70)",
    inputs=["frozen baseline (C1)", "rollout engine and perf.baseline", "train engine", "perf"],
    artifacts=["artifacts/C10/requests.jsonl", "artifacts/C10/summary.json"], guide="guides/C10.md",
    measure=measure, judge=judge)
