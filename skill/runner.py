"""The tiny runner: for each gate, measure -> judge -> record. Bad input stops everything (exit 2, no write)."""

from __future__ import annotations

import time
import traceback

import tic
from tic import patches
from tic.gates import REGISTRY, gate_range
from tic.gates.base import Gate, Measurement, Verdict
from tic.harness.measure.metrics import NonFiniteLogprob
from tic.harness.model import generate
from tic.skill.context import GateContext
from tic.core.errors import TicInputError, raised_at
from tic.skill.fingerprint import input_hashes, reads_of
from tic.skill.preflight import validate_run
from tic.skill.records import GateResult, environment_fingerprint


def _guarded(gate: Gate, ctx: GateContext, load, *args) -> dict | None:
    """On a failed consistency gate with the locator on, load()(*args): a search's findings, or why it could not
    run; None when the locator is off. The verdict stands whatever the search does."""
    if not (gate.locate_on_fail and ctx.cfg.locate.enabled):
        return None
    try:
        search = load()
    except ImportError:
        return {"status": "locator not available in this release"}
    try:
        return search(*args)
    except TicInputError:
        raise
    except Exception as e:  # localisation broke: say so in the record, and where
        return {"status": f"locator error: {type(e).__name__}: {e} (at {raised_at(e)})"}


def _locate(gate: Gate, ctx: GateContext, measured: Measurement) -> tuple[dict | None, list[str]]:
    """On a failed consistency gate, run the locator and return its findings (or why it could not)."""
    def load():
        from tic.harness.locate.search import locate_for_gate
        return locate_for_gate

    findings = _guarded(gate, ctx, load, ctx, gate.id, measured)
    evidence = [v for k, v in (findings or {}).items() if k in ("report", "repro", "chart") and v]
    return findings, evidence


def _locate_nonfinite(gate: Gate, ctx: GateContext, e: NonFiniteLogprob) -> dict | None:
    """The module and operator that made a failing gate's NaN or Inf (tic.harness.locate.nonfinite), or why not."""
    def load():
        from tic.harness.locate.nonfinite import locate_nonfinite
        return locate_nonfinite

    return _guarded(gate, ctx, load, ctx, e.side, e.sequence)


def _patch_choices() -> dict:
    """What the active patches chose at run time in this process (e.g. which GEMM problems run cuBLAS), where any
    did: how a record's rollout ran, beside which patches were active."""
    got = patches.choices()
    return {"patch_choices": got} if got else {}


def _layouts(ctx: GateContext) -> dict:
    return {side: getattr(ctx.cfg, side).parallel.model_dump() for side in ("rollout", "train")}


BUILT = ("cut",)  # inputs a gate of the run builds itself (C2 cuts, then checks, the cut): hashed as built


def _read_hashes(gate: Gate, ctx: GateContext, fresh: bool = False) -> tuple[str, dict[str, str]]:
    """(model hash, input hashes) of what the gate reads; fresh: the model hashed again, not the run's first."""
    try:
        mhash = (generate.model_hash(ctx.model.dir) if fresh else ctx.model_hash) if gate.needs_model else ""
    except TicInputError:
        mhash = ""
    return mhash, input_hashes(ctx.cfg, reads_of(gate))


def _refuse_changed_during(gate: Gate, before: tuple[str, dict], after: tuple[str, dict]) -> None:
    """A record's hashes must be of the bytes the gate measured: hashed before, hashed again after, and a file
    that changed meanwhile (a dump its producer was still writing) makes the run an input error, not a record."""
    changed = ["the model"] if before[0] != after[0] else []
    changed += sorted(k for k in set(before[1]) | set(after[1])
                      if k not in BUILT and before[1].get(k) != after[1].get(k))
    if changed:
        raise TicInputError(f"{gate.id}: {', '.join(changed)} changed while the gate read it, so no result is "
                            "recorded; rerun once the files are complete")


def run_gate(gate: Gate, ctx: GateContext, save: bool = True) -> GateResult:
    t0 = time.perf_counter()
    details: dict = {}
    evidence: list[str] = []
    metrics: dict = {}
    read_before = _read_hashes(gate, ctx)
    try:
        measured = gate.measure(ctx)
        metrics, details, evidence = dict(measured.metrics), dict(measured.details), list(measured.evidence)
        if measured.unavailable:  # measured nothing here: never judged, never a pass
            verdict, reason, key = Verdict.UNAVAILABLE, measured.unavailable, ""
        else:
            j = gate.judge(measured)
            verdict, reason, key = j.verdict, j.reason, j.key_figure
        if verdict == Verdict.FAIL:
            found, ev = _locate(gate, ctx, measured)
            if found is not None:
                details["locate"] = found
                evidence += ev
    except TicInputError:
        raise
    except NonFiniteLogprob as e:
        verdict, reason, key = Verdict.FAIL, f"non-finite logprob: {e}", "NaN/Inf"
        found = _locate_nonfinite(gate, ctx, e)
        if found is not None:
            details["locate"] = found
    except Exception as e:
        verdict, reason, key = Verdict.ERROR, f"{type(e).__name__}: {e}", ""
        details = {"traceback": traceback.format_exc()}
    read_after = _read_hashes(gate, ctx, fresh=True)
    _refuse_changed_during(gate, read_before, read_after)
    mhash, inputs = read_before[0], {**read_before[1], **{k: read_after[1][k] for k in BUILT if k in read_after[1]}}
    res = GateResult(gate=gate.id, title=gate.title, verdict=verdict, reason=reason, key_figure=key, metrics=metrics,
                     details=details, evidence=evidence, config_hash=ctx.cfg.config_hash(), model_hash=mhash,
                     inputs=inputs, environment={**environment_fingerprint(), "parallel": _layouts(ctx),
                                                  **_patch_choices()},
                     tic_version=tic.__version__, duration_s=round(time.perf_counter() - t0, 3))
    if save:
        if verdict == Verdict.PASS and gate.locate_on_fail and ctx.state.clear_locate(gate.id):
            res.details["locate_cleared"] = f"removed the previous failure's {ctx.state.locate_dir(gate.id)}"
        ctx.state.save(res)
    return res


def run_ladder(ctx: GateContext, start: str = "C0", stop: str = "C10", keep_going: bool = False,
               on_result=None, validate: bool = True) -> list[GateResult]:
    """Gates in order. A fail or error stops the climb unless keep_going; unavailable gates do not.
    Every input of every gate in the range is checked first: a bad one stops the ladder before any write."""
    if validate:
        validate_run(ctx, gate_range(start, stop))
    results: list[GateResult] = []
    blocked_by = None
    for gate in gate_range(start, stop):
        if blocked_by is not None:
            res = GateResult(gate=gate.id, title=gate.title, verdict=Verdict.SKIPPED,
                             reason=f"not run: {blocked_by} did not pass (use --keep-going)")
        else:
            res = run_gate(gate, ctx)
            if res.verdict in (Verdict.FAIL, Verdict.ERROR) and not keep_going:
                blocked_by = gate.id
        results.append(res)
        if on_result:
            on_result(res)
    return results


EXIT_WAITING = 4  # nothing failed; a gate waits for a step (C1's baseline, a person's approval)


def exit_code(results: list[GateResult]) -> int:
    if any(r.verdict == Verdict.ERROR for r in results):
        return 3
    if results and all(r.verdict == Verdict.PASS for r in results):
        return 0
    if results and all(r.verdict in (Verdict.PASS, Verdict.WAITING) for r in results):
        return EXIT_WAITING
    return 1


def waiting_hint(results: list[GateResult]) -> str | None:
    """The steps the waiting gates wait for, one line each, when waiting is all that keeps the exit code off 0."""
    if exit_code(results) != EXIT_WAITING:
        return None
    return "\n".join(f"{r.gate} {r.reason}" for r in results if r.verdict == Verdict.WAITING)


def unavailable_hint(results: list[GateResult]) -> str | None:
    """When the only non-passing gates are unavailable ones: say so, and which --from/--to ranges hold only gates
    this release measures (an unavailable gate is never a pass, so the exit code stays 1)."""
    if not results or any(r.verdict not in (Verdict.PASS, Verdict.UNAVAILABLE) for r in results):
        return None
    missing = [r.gate for r in results if r.verdict == Verdict.UNAVAILABLE]
    if not missing:
        return None
    runs, cur = [], []
    for r in results:
        if r.verdict == Verdict.PASS:
            cur.append(r.gate)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    ranges = " or ".join(f"tic ladder --from {run[0]} --to {run[-1]}" for run in runs)
    return (f"exit 1 only because {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} unavailable in this "
            f"release (not checked; never a pass). Every measured gate passed"
            + (f"; to run only measured gates: {ranges}" if ranges else "") + ".")


__all__ = ["run_gate", "run_ladder", "exit_code", "validate_run", "unavailable_hint", "waiting_hint", "REGISTRY"]
