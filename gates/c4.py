"""C4: phase consistency in inference. Token-by-token decode must give the same logprobs as scoring the
whole sequence in one prefill, in the same engine."""

from __future__ import annotations

from tic.gates.base import Gate, Judgement, Measurement, Verdict
from tic.harness.measure.metrics import compare_logprobs, is_exact_match, summary


def measure(ctx) -> Measurement:
    eng = ctx.live_rollout_engine("C4")
    samples = ctx.rollout_samples()
    scored = eng.score(samples, ctx.sampling)
    m = compare_logprobs([s.logprobs for s in samples], scored, [s.mask for s in samples])
    return Measurement(metrics=m, details={"decode": "rollout sampling with KV cache", "prefill": "engine.score"})


def judge(m: Measurement) -> Judgement:
    x = m.metrics
    if is_exact_match(x):
        return Judgement(Verdict.PASS, "decode and prefill scoring are bitwise identical on every token", summary(x))
    f = x["first_mismatch"]
    return Judgement(Verdict.FAIL, f"decode vs prefill differ; first at sequence {f['sequence']}, position "
                                   f"{f['position']}: {f['rollout']!r} vs {f['train']!r} ({f['ulps']} ulp)", summary(x))


GATE = Gate(
    id="C4", title="Decode vs prefill (inference)", step=2,
    measures="logprobs of the sampled tokens from token-by-token decode vs one whole-sequence prefill in the "
             "rollout engine; |p_decode - p_prefill| per token, k3 KL, bitwise-equal fraction",
    pass_condition="max, mean and std of |dp| and k3 KL are exactly 0 and 100% of logprobs are bitwise equal",
    inputs=["rollout engine (live)", "prompts", "sampling"], artifacts=[], guide="guides/C4.md",
    measure=measure, judge=judge, locate_on_fail=True, reads=("rollout", "prompts"),
    validate=lambda ctx: ctx.require_live("rollout", "C4"))
