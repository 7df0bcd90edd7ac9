"""C5: training recompute vs rollout. The training forward must reproduce the rollout's logprob of every
sampled token bit for bit (the method's diff = 0)."""

from __future__ import annotations

from tic.gates.base import Gate, Judgement, Measurement, Verdict
from tic.harness.measure.metrics import compare_dump_files, compare_logprobs, is_exact_match, summary


def measure(ctx) -> Measurement:
    r, t = ctx.cfg.rollout, ctx.cfg.train
    if r.engine == "dump" and t.engine == "dump":  # both sides recorded: stream the two files together
        m = compare_dump_files(ctx.cfg.resolve(r.dump), ctx.cfg.resolve(t.dump))
    else:
        samples = ctx.rollout_samples()
        train = ctx.train_logprobs()
        m = compare_logprobs([s.logprobs for s in samples], train, [s.mask for s in samples])
    return Measurement(metrics=m, details={"rollout": ctx.cfg.rollout.engine, "train": ctx.cfg.train.engine})


def judge(m: Measurement) -> Judgement:
    x = m.metrics
    if is_exact_match(x):
        return Judgement(Verdict.PASS, "diff = 0: every sampled token's logprob is bitwise identical", summary(x))
    f = x["first_mismatch"]
    return Judgement(Verdict.FAIL, f"train differs from rollout; first at sequence {f['sequence']}, position "
                                   f"{f['position']}: rollout {f['rollout']!r} vs train {f['train']!r} "
                                   f"({f['ulps']} ulp)", summary(x))


GATE = Gate(
    id="C5", title="Training recompute vs rollout", step=3,
    measures="per valid token, |p_rollout - p_train| (max, mean, std), k3 KL, bitwise-equal fraction and the "
             "first mismatch with its ulp distance; from live engines or from dumps",
    pass_condition="max = mean = std = k3 KL = 0 exactly and every logprob bitwise equal (diff = 0)",
    inputs=["rollout engine or dump", "train engine or dump", "prompts", "sampling"], artifacts=[],
    guide="guides/C5.md", measure=measure, judge=judge, locate_on_fail=True, reads=("rollout", "train", "prompts"))
