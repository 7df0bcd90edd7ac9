"""`tic baseline run | freeze | approve | show`: the frozen, human-approved performance baseline (C1)."""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import click

CONFIG_OPT = click.option("-c", "--config", "config_path", default="tic.yaml", show_default=True,
                          type=click.Path(dir_okay=False, path_type=Path), help="tic.yaml to use")
JSON_OPT = click.option("--json", "as_json", is_flag=True, help="print a machine-readable record on stdout")


def _done(as_json: bool, line: str, record: dict) -> None:
    """The outcome: one line for a person, or (--json) the record on stdout and the line on stderr."""
    from tic.skill import report

    click.echo(line, err=as_json)
    if as_json:
        report.print_json(record)


def _ctx(config_path: Path):
    from tic.config.schema import load_config
    from tic.skill.context import GateContext

    return GateContext(load_config(config_path))


def measure_baseline(ctx) -> tuple[dict, list[dict]]:
    """The baseline side on the configured workload: (baseline.json record, per-request raw records)."""
    import tic
    from tic.gates.c1 import perf_side
    from tic.harness.measure.perf import Workload, measure_sides, pass_summary, side_fingerprint, spread

    engine, env = perf_side(ctx, "baseline")
    wl, p = Workload.from_config(ctx.cfg), ctx.cfg.perf
    passes = measure_sides({"baseline": (engine, env)}, wl, ctx.vocab_size, p.warmup, p.repeats)
    record = {
        "workload": wl.as_dict(),
        "fingerprint": side_fingerprint(engine, env, wl, ctx.model_hash),
        "passes": [pass_summary(x) for x in passes],
        "throughput_tok_s": spread([x["throughput_tok_s"] for x in passes]),
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config_hash": ctx.cfg.config_hash(), "tic_version": tic.__version__,
    }
    return record, [r for x in passes for r in x["requests"]]


@click.group("baseline")
def command():
    """The performance baseline C1 freezes and C10 compares against: measure it on the workload of tic.yaml's
    perf: section, freeze its files (content hash), and have a person approve it."""


@command.command("run")
@CONFIG_OPT
@click.option("--replace", is_flag=True, help="discard a frozen baseline (and its approval) and measure anew")
@JSON_OPT
def run_cmd(config_path, replace, as_json):
    """Measure the ordinary (non-consistent) rollout: per-request raw data and the environment fingerprint."""
    from tic.harness.measure.baseline import FREEZE, baseline_dir, write_baseline
    from tic.core.errors import TicInputError
    from tic.skill import report

    ctx = _ctx(config_path)
    d = baseline_dir(ctx.cfg)
    if (d / FREEZE).exists() and not replace:
        raise TicInputError(f"{d} holds a frozen baseline; `tic baseline run --replace` discards it (and its "
                            "approval)")
    with report.progress("measuring the baseline rollout ...", as_json):
        record, requests = measure_baseline(ctx)
    write_baseline(d, record, requests, replace=replace)
    t = record["throughput_tok_s"]
    _done(as_json, f"baseline written to {d}: {len(requests)} request records, median {t['median']:.1f} tok/s "
                   f"(min {t['min']:.1f}, max {t['max']:.1f}); next: `tic baseline freeze`",
          {"directory": str(d), "requests": len(requests), "throughput_tok_s": t, "next": "tic baseline freeze"})


@command.command("freeze")
@CONFIG_OPT
@JSON_OPT
def freeze_cmd(config_path, as_json):
    """Record the content hash of the baseline files; any later edit fails C1 and C10."""
    from tic.harness.measure.baseline import baseline_dir, freeze

    d = baseline_dir(_ctx(config_path).cfg)
    rec = freeze(d)
    _done(as_json, f"baseline frozen: {rec['hash'][:16]}; next: a person reviews it and runs "
                   "`tic baseline approve --by NAME`",
          {"directory": str(d), "hash": rec["hash"], "next": "a person runs tic baseline approve --by NAME"})


@command.command("approve")
@CONFIG_OPT
@click.option("--by", "by", required=True, help="who reviewed and approves the frozen baseline")
@JSON_OPT
def approve_cmd(config_path, by, as_json):
    """Human sign-off on the frozen baseline (its hash is recorded with the name)."""
    from tic.harness.measure.baseline import approve, baseline_dir

    d = baseline_dir(_ctx(config_path).cfg)
    rec = approve(d, by)
    _done(as_json, f"baseline {rec['hash'][:16]} approved by {rec['by']}",
          {"directory": str(d), "hash": rec["hash"], "by": rec["by"]})


@command.command("show")
@CONFIG_OPT
@click.option("--json", "as_json", is_flag=True, help="print the status as JSON on stdout")
def show_cmd(config_path, as_json):
    """Where the baseline stands: measured, frozen, approved, files unchanged."""
    from tic.harness.measure.baseline import baseline_dir, verify

    st = verify(baseline_dir(_ctx(config_path).cfg))
    if as_json:
        click.echo(json.dumps({k: v for k, v in asdict(st).items() if k != "record"} | {"valid": st.valid}))
        return
    t = st.record.get("throughput_tok_s", {})
    click.echo(f"{st.directory}: exists={st.exists} frozen={st.frozen} approved={st.approved}"
               + (f" by {st.approved_by}" if st.approved else "")
               + (f", median {t['median']:.1f} tok/s" if t.get("median") else ""))
    for p in st.all_problems:
        click.echo(f"  - {p}")
