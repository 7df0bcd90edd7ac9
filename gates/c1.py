"""C1: the frozen performance baseline. Measured by `tic baseline run`, frozen by `tic baseline freeze`,
signed off by `tic baseline approve --by NAME`; this gate checks that all three hold and that the files are
still the bytes that were frozen and approved."""

from __future__ import annotations

from tic.gates.base import Gate, Judgement, Measurement, Verdict
from tic.harness.engines.base import Engine
from tic.harness.measure.baseline import DATA_FILES, baseline_dir, verify
from tic.harness.measure.perf import side_config


def perf_side(ctx, which: str) -> tuple[Engine, dict[str, str]]:
    """('baseline' | 'consistent') -> (rollout engine, env vars it runs under): the side `tic baseline run`
    measures for C1, and the two C10 compares."""
    side_cfg, env = side_config(ctx.cfg.rollout, ctx.cfg.perf, which)
    return ctx.side_engine(f"perf {which}", "rollout", side_cfg, env), env


def measure(ctx) -> Measurement:
    d = baseline_dir(ctx.cfg)
    st = verify(d)
    t = st.record.get("throughput_tok_s", {})
    wl = st.record.get("workload", {})
    return Measurement(
        metrics={"exists": st.exists, "frozen": st.frozen, "approved": st.approved, "waiting": st.waiting,
                 "problems": len(st.all_problems), "median_tok_s": t.get("median"),
                 "passes": t.get("n"), "requests": wl.get("requests")},
        details={"directory": str(d), "hash": st.hash, "approved_by": st.approved_by,
                 "problems": st.all_problems, "workload": wl, "throughput_tok_s": t,
                 "fingerprint": st.record.get("fingerprint", {})},
        evidence=[str(d / n) for n in DATA_FILES if (d / n).is_file()],
    )


def judge(m: Measurement) -> Judgement:
    x, d = m.metrics, m.details
    key = (f"median {x['median_tok_s']:.1f} tok/s over {x['passes']} passes" if x["median_tok_s"] else
           "no baseline measured")
    if x["exists"] and x["frozen"] and x["approved"] and x["problems"] == 0:
        return Judgement(Verdict.PASS, f"baseline {d['hash'][:12]} frozen, approved by {d['approved_by']}, files "
                                       "unchanged since", key)
    if x["waiting"]:  # nothing is wrong yet: the climb goes on, the exit code says a step is outstanding
        return Judgement(Verdict.WAITING, f"waiting: {d['problems'][0]}", key)
    return Judgement(Verdict.FAIL, "; ".join(d["problems"]) or "baseline not frozen and approved", key)


GATE = Gate(
    id="C1", title="Frozen performance baseline", step=1,
    measures="the baseline directory written by `tic baseline run` (per-request raw timings, workload, environment "
             "fingerprint), its freeze record (sha256 of each file) and its approval (name + frozen hash)",
    pass_condition="a baseline exists, is frozen and approved by a named person for the same hash, and every "
                   "baseline file still has the sha256 recorded at freezing (any later edit fails)",
    inputs=["perf (workload)", "baseline directory (perf.baseline_dir, default .tic/baseline)"],
    artifacts=["baseline/baseline.json", "baseline/requests.jsonl", "baseline/freeze.json",
               "baseline/approval.json"],
    guide="guides/C1.md", measure=measure, judge=judge, needs_model=False)
