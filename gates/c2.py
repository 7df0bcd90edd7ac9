"""C2: small model cut. A 4-6 layer cut of the full model stands in for it in fast loops only if it loads,
covers every operator class, keeps each kept layer's tensors exactly, and each kept layer computes exactly
what its source layer computes on the same hidden states."""

from __future__ import annotations

import json

from tic.gates.base import Gate, Judgement, Measurement, Verdict
from tic.harness.model.cut import CUT_RECORD
from tic.harness.model.cut_check import CutRequest, check_cut, cut_dir_for
from tic.core.fsio import atomic_write_text


def cut_request(cfg, state) -> CutRequest:
    """tic.yaml's cut: section; without cut.out, tic's own cut among C2's artifacts in the state directory."""
    return CutRequest.from_config(cfg.cut, cfg.resolve, state.artifacts_dir("C2") / "cut")


def measure(ctx) -> Measurement:
    cut_dir = cut_dir_for(cut_request(ctx.cfg, ctx.state), ctx.model.dir, ctx.model_hash)
    r = check_cut(ctx.model.dir, cut_dir)
    path = ctx.artifacts("C2") / "check.json"
    atomic_write_text(path, json.dumps({**r, "cut_dir": str(cut_dir)}, indent=2, default=str))
    eq = sum(1 for x in r["fidelity"] if x["equal"])
    return Measurement(
        metrics={"kept_layers": len(r["layers"]), "full_layers": r.get("full_layers", 0),
                 "missing_classes": len(r["missing_classes"]), "layers_bitwise_equal": eq,
                 "layers_checked": len(r["fidelity"]), "problems": len(r["problems"])},
        details={"cut_dir": str(cut_dir), "layers": r["layers"], "problems": r["problems"],
                 "missing_transitions": r.get("missing_transitions", []), "explanation": r.get("explanation", []),
                 "notes": r.get("notes", []), "engines_checked": r.get("engines_checked", ["hf"])},
        evidence=[str(path), str(cut_dir / CUT_RECORD)],
    )


def judge(m: Measurement) -> Judgement:
    x, d = m.metrics, m.details
    key = (f"layers {d['layers']} of {x['full_layers']}; {x['layers_bitwise_equal']}/{x['layers_checked']} "
           f"layers bitwise equal")
    if d["problems"]:
        more = f" (+{len(d['problems']) - 1} more)" if len(d["problems"]) > 1 else ""
        return Judgement(Verdict.FAIL, d["problems"][0] + more, key)
    if x["layers_checked"] == 0 or x["layers_bitwise_equal"] != x["layers_checked"]:
        return Judgement(Verdict.FAIL, "no kept layer was checked for fidelity", key)
    return Judgement(Verdict.PASS, "cut loads, covers every operator class, keeps each layer's tensors, and every kept "
                                   "layer is bitwise equal to its source on the same hidden states", key)


GATE = Gate(
    id="C2", title="Small model cut", step=2,
    measures="a 4-6 layer cut of the full model: operator-class coverage, per-layer shapes/dtypes, layer fidelity",
    pass_condition="the cut loads; its manifest covers every operator class of the full model; per-layer shapes "
                   "and dtypes equal the source layers'; each kept layer gives bitwise identical outputs to its "
                   "source layer on the same hidden states",
    inputs=["model.path (the full model)", "cut: out/layers/max_layers (optional; else cut into artifacts/C2/cut)"],
    artifacts=["artifacts/C2/check.json", "artifacts/C2/cut/ (when tic.yaml has no cut.out)"],
    guide="guides/C2.md", measure=measure, judge=judge, reads=("model", "cut"))
