"""The tiny runner: for each gate, measure -> judge -> record. Bad input stops everything (exit 2, no write)."""

from __future__ import annotations

import time
import traceback

import tic
from tic.gates import REGISTRY, gate_range
from tic.gates.base import UNAVAILABLE, Gate
from tic.harness.metrics import NonFiniteLogprob
from tic.skill.context import GateContext
from tic.core.errors import TicInputError
from tic.skill.records import GateResult, environment_fingerprint


def _locate(gate: Gate, ctx: GateContext, measured: dict) -> tuple[dict | None, list[str]]:
    """On a failed consistency gate, run the locator and return its findings (or why it could not)."""
    if not (gate.locate_on_fail and ctx.cfg.locate.enabled):
        return None, []
    try:
        from tic.harness.locate import locate_for_gate
    except ImportError:
        return {"status": "locator not available in this release"}, []
    try:
        findings = locate_for_gate(ctx, gate.id, measured)
    except TicInputError:
        raise
    except Exception as e:  # the verdict stands even if localisation breaks; say so in the record
        return {"status": f"locator error: {type(e).__name__}: {e}"}, []
    evidence = [v for k, v in (findings or {}).items() if k in ("report", "repro", "chart") and v]
    return findings, evidence


def _layouts(ctx: GateContext) -> dict:
    return {side: getattr(ctx.cfg, side).parallel.model_dump() for side in ("rollout", "train")}


def run_gate(gate: Gate, ctx: GateContext, save: bool = True) -> GateResult:
    t0 = time.perf_counter()
    base = dict(gate=gate.id, title=gate.title, config_hash=ctx.cfg.config_hash(), tic_version=tic.__version__)
    if not gate.available:
        res = GateResult(**base, verdict="unavailable", reason=UNAVAILABLE,
                         details={"implemented_by": gate.implemented_by})
        if save:
            ctx.state.save(res)
        return res
    details: dict = {}
    evidence: list[str] = []
    metrics: dict = {}
    try:
        measured = gate.measure(ctx)
        j = gate.judge(measured)
        verdict, reason, key = j.verdict, j.reason, j.key_figure
        metrics = measured.get("metrics", {})
        details = measured.get("details", {})
        evidence = list(measured.get("evidence", []))
        if verdict == "fail":
            found, ev = _locate(gate, ctx, measured)
            if found is not None:
                details["locate"] = found
                evidence += ev
    except TicInputError:
        raise
    except NonFiniteLogprob as e:
        verdict, reason, key = "fail", f"non-finite logprob: {e}", "NaN/Inf"
    except Exception as e:
        verdict, reason, key = "error", f"{type(e).__name__}: {e}", ""
        details = {"traceback": traceback.format_exc()}
    try:
        mhash = ctx.model_hash if gate.needs_model else ""
    except TicInputError:
        mhash = ""
    res = GateResult(**base, verdict=verdict, reason=reason, key_figure=key, metrics=metrics, details=details,
                     evidence=evidence, model_hash=mhash, environment=environment_fingerprint(_layouts(ctx)),
                     duration_s=round(time.perf_counter() - t0, 3))
    if save:
        ctx.state.save(res)
    return res


def run_ladder(ctx: GateContext, start: str = "C0", stop: str = "C10", keep_going: bool = False,
               on_result=None) -> list[GateResult]:
    """Gates in order. A fail or error stops the climb unless keep_going; unavailable gates do not."""
    results: list[GateResult] = []
    blocked_by = None
    for gate in gate_range(start, stop):
        if blocked_by is not None:
            res = GateResult(gate=gate.id, title=gate.title, verdict="skipped",
                             reason=f"not run: {blocked_by} did not pass (use --keep-going)")
        else:
            res = run_gate(gate, ctx)
            if res.verdict in ("fail", "error") and not keep_going:
                blocked_by = gate.id
        results.append(res)
        if on_result:
            on_result(res)
    return results


def exit_code(results: list[GateResult]) -> int:
    if any(r.verdict == "error" for r in results):
        return 3
    return 0 if results and all(r.verdict == "pass" for r in results) else 1


__all__ = ["run_gate", "run_ladder", "exit_code", "REGISTRY"]
