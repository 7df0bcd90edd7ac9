"""`tic locate`: run a consistency gate, and if it differs, localise its first mismatch (layer, module,
operator) and emit a verified minimal repro. The gate's record is not rewritten; `tic gate`/`tic ladder` do
that and link the same report when locate.enabled is on."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from tic.core.errors import TicInputError

LOCATABLE = ("C3", "C4", "C5", "C6")


@click.command("locate", epilog="""\b
Exit codes:
  0  the gate shows no divergence
  1  a divergence was found and localised (see the report)
  2  usage error or bad input
  3  internal error""")
@click.option("-c", "--config", "config_path", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="tic.yaml to use [default: ./tic.yaml]")
@click.option("--gate", "gate_id", default="C5", show_default=True, help="which comparison to localise: C3, C4, C5 or C6")
@click.option("--json", "as_json", is_flag=True, help="print the findings as JSON on stdout")
@click.option("--eager", is_flag=True,
              help="measure and localise with the rollout run eagerly (vLLM: no torch.compile, no CUDA graphs, the "
                   "same patches), where module hooks see every forward; for a rollout in a compiled mode")
def command(config_path, gate_id, as_json, eager):
    """Find the first divergent layer and operator of a failing C3/C4/C5/C6 and write a minimal repro."""
    from tic.gates import get
    from tic.harness.locate.search import locate_for_gate
    from tic.skill import report
    from tic.config.schema import load_config
    from tic.skill.context import GateContext

    gate_id = gate_id.upper()
    if gate_id not in LOCATABLE:
        raise TicInputError(f"--gate {gate_id}: the locator covers C3, C4, C5 or C6")
    gate = get(gate_id)
    from tic.skill.preflight import validate_run

    cfg = load_config(config_path)
    con = report.console()
    note = None
    if eager:
        configured = cfg
        cfg, note = eager_rollout(cfg)
        con.print(note)
        eager = cfg is not configured  # an eager rollout is measured as configured: its pass is the gate's
    ctx = GateContext(cfg)
    validate_run(ctx, [gate])  # every input checked before the locator writes anything
    with report.progress(f"measuring {gate_id} ...", as_json, con):
        measured = gate.measure(ctx)
        verdict = gate.judge(measured)
    if verdict.verdict == "pass":
        con.print(f"{gate_id} passes ({verdict.key_figure}): no divergence to localise"
                  + (" with the rollout eager; a failure in the configured mode then comes from its compiled code "
                     "or CUDA graphs (guides/vllm.md, the compiled mode)" if eager else ""))
        if not eager and ctx.state.clear_locate(gate_id):  # an eager pass says nothing of the configured mode
            con.print(f"removed the previous failure's report and repro ({ctx.state.locate_dir(gate_id)})")
        if as_json:
            report.print_json({"gate": gate_id, "status": "no divergence"})
        sys.exit(0)
    with report.progress(f"localising {gate_id}: {verdict.reason} ...", as_json, con):
        found = locate_for_gate(ctx, gate_id, measured, strict=True, run_changes=note if eager else None)
    con.print(f"{gate_id}: {verdict.reason}")
    for row in found["layers"]:
        mark = "  <- first divergent" if row["first_divergent"] else ""
        con.print(f"  {row['stage']:<40} {'equal' if row['equal'] else 'differs':<8} max {row['max_ulp']} ulp{mark}")
    con.print(f"status:    {found['status']}")
    con.print(f"module:    {' > '.join(found['module_trail']) or '-'}")
    con.print(f"operator:  {found['first_operator'] or '-'}")
    diff = found.get("difference")
    if diff:
        con.print(f"kind:      {diff['kind']}: {diff['detail']}")
    check = found.get("repro_check") or {}
    con.print(f"repro:     {found['repro'] or 'not emitted'}"
              + (f" (rows A {check.get('rows_a')}, B {check.get('rows_b')}; fresh run: {check.get('output')})"
                 if found["repro"] else
                 f" (a fresh run exited {check.get('exit_code')}: {check.get('output')})" if check else ""))
    con.print(f"report:    {found['report']}\nchart:     {found['chart']}")
    con.print(f"cost:      {found['forward_passes']} forward passes, {found['seconds']} s")
    if as_json:
        report.print_json({"gate": gate_id, **found})
    sys.exit(1 if found["first_divergent_layer"] or found["culprit_module"] else 0)


def eager_rollout(cfg):
    """(cfg with the rollout as the locator can capture it, one line saying what changed): the rollout engine's
    capture_changes; an eager rollout is left as it is."""
    from tic.harness.engines import engine_class

    changes = engine_class(cfg.rollout).capture_changes(cfg.rollout)
    if not changes:
        return cfg, f"--eager: the rollout ({cfg.rollout.engine}) runs eagerly already; nothing changed"
    changed = ", ".join(f"{k}: {v}" for k, v in sorted(changes.get("options", {}).items())
                        if cfg.rollout.options.get(k) != v)
    return (cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update=changes)}),
            f"--eager: rollout.options {changed} for this run (the gate's record is not rewritten)")
