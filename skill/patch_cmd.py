"""`tic patch`: the bundled patches (list, show one, which are active inside vLLM in this environment)."""

from __future__ import annotations

import json
import os

import click


@click.group("patch")
def command():
    """Bundled fixes for the rollout engine. Enable them with `rollout: {patches: [NAME, ...]}` in tic.yaml, or
    for a job tic does not start, TIC_PATCHES=NAME,NAME in its environment (vLLM loads them through its
    `vllm.general_plugins` entry point in every process)."""


@command.command("list")
@click.option("--json", "as_json", is_flag=True, help="print the metadata as JSON")
def list_(as_json):
    """Every bundled patch: name, target versions, the gate it fixes, its symptom."""
    from tic import patches
    from tic.skill import report

    reg = patches.registry()
    if as_json:
        report.print_json([p.describe() for p in reg.values()])
        return
    from rich.table import Table

    t = Table(title="bundled patches (tic patch show NAME)")
    for col in ("name", "target", "gate", "symptom"):
        t.add_column(col, overflow="fold")
    for p in reg.values():
        t.add_row(p.name, f"{p.target}{p.versions}", p.gate, p.symptom)
    report.console().print(t)


@command.command("show")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="print the metadata as JSON")
def show(name, as_json):
    """One patch's metadata: symptom, fix, gate, guide, cost, target versions."""
    from tic import patches
    from tic.skill import report

    p = patches.get(name)
    if as_json:
        report.print_json(p.describe())
        return
    for k, v in p.describe().items():
        click.echo(f"{k}: {v}")


@command.command("status")
@click.option("--json", "as_json", is_flag=True, help="print the patches' state as JSON")
def status(as_json):
    """Which patches are active in this environment, verified from inside vLLM: loads vLLM's general plugins
    (as every vLLM process does) with this environment's TIC_PATCHES and reads the patched objects back."""
    from tic import patches
    from tic.core.errors import TicInputError

    requested = patches.parse_names(os.environ.get(patches.ENV_VAR))
    reg = patches.registry()
    for n in requested:
        reg[n].check_target()
    targets = {p.target for p in reg.values()}
    installed = {t: next(p.installed_version() for p in reg.values() if p.target == t) for t in targets}
    rows = []
    if installed.get("vllm"):
        try:
            from vllm.plugins import load_general_plugins
        except ImportError as e:
            raise TicInputError(f"vLLM {installed['vllm']} is installed but cannot be imported: {e}") from None
        load_general_plugins()
    active = set(patches.active())
    for p in reg.values():
        rows.append({"name": p.name, "requested": p.name in requested, "active": p.name in active,
                     "target": p.target, "installed": installed.get(p.target), "supported": p.target_installed()})
    missing = [r["name"] for r in rows if r["requested"] and not r["active"]]
    if as_json:
        click.echo(json.dumps({"env": os.environ.get(patches.ENV_VAR, ""), "patches": rows}, indent=1))
    else:
        for r in rows:
            state = "active" if r["active"] else ("REQUESTED, NOT ACTIVE" if r["requested"] else "off")
            click.echo(f"{r['name']:<22} {state:<22} {r['target']} {r['installed'] or 'not installed'}"
                       f"{'' if r['supported'] or not r['installed'] else ' (unsupported version)'}")
    if missing:
        raise TicInputError(f"requested in {patches.ENV_VAR} but not active: {', '.join(missing)} "
                            "(is tic installed as a package, so that vLLM finds its plugin entry point?)")
