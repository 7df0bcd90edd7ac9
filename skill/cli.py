"""The `tic` command line."""

from __future__ import annotations

import importlib
import inspect
import os
import signal
import sys
import textwrap
import threading
from pathlib import Path

import click
from contextlib import ExitStack, contextmanager

import tic
from tic.core.errors import EXIT_INPUT, EXIT_INTERNAL, TicInputError

EXIT_CODES = """\b
Exit codes:
  0  every gate run passed
  1  a gate failed, or is unavailable / skipped (never counted as a pass)
  2  usage error or bad input (config, dump, model files); .tic/ is left untouched
  3  internal error
  4  nothing failed, but a gate is waiting (C1/C10: the baseline to run or freeze, or a person's approval)"""

CONFIG_OPT = click.option("-c", "--config", "config_path", default=None, type=click.Path(dir_okay=False, path_type=Path),
                          help="tic.yaml to use [default: ./tic.yaml]; results go to .tic/ beside it")
JSON_OPT = click.option("--json", "as_json", is_flag=True, help="print a machine-readable record on stdout")
JUNIT_OPT = click.option("--junit", "junit", type=click.Path(dir_okay=False, path_type=Path),
                         help="write JUnit XML to this file")


def _context(config_path: Path):
    from tic.config.schema import load_config
    from tic.skill.context import GateContext

    return GateContext(load_config(config_path))


@contextmanager
def _stdout_reserved(as_json: bool):
    """--json: stdout carries the JSON record alone. While gates run, whatever reaches file descriptor 1
    (vLLM's logger, engine and rank processes it starts, C extensions) goes to stderr instead."""
    if not as_json:
        yield
        return
    stdout = sys.stdout
    stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        # text written meanwhile through stdout objects held from before (a log handler, sys.__stdout__) still
        # sits in their buffers: it leaves now, while fd 1 is stderr, not ahead of the record later
        for f in {id(f): f for f in (sys.stdout, stdout, sys.__stdout__) if f is not None}.values():
            f.flush()
        sys.stdout = stdout
        os.dup2(saved, 1)
        os.close(saved)


def _finish(results, as_json: bool, junit: Path | None, title: str) -> None:
    from tic.skill import report
    from tic.skill.runner import exit_code, unavailable_hint, waiting_hint

    code = exit_code(results)
    report.console().print(report.ladder_table(results, title))
    for r in results:  # lines a gate asks to show below the table (C0: the per-layer kernel coverage)
        for line in r.details.get("show", []):
            report.console().print(f"{r.gate} {line}", markup=False, soft_wrap=True)
    for hint in (unavailable_hint(results), waiting_hint(results)):
        if hint:
            report.console().print(hint, markup=False, soft_wrap=True)
    if junit:
        report.write_junit(junit, results)
    if as_json:
        report.print_json({"tic_version": tic.__version__, "exit_code": code,
                           "results": [r.model_dump(mode="json") for r in results]})
    sys.exit(code)


def _quiet_libraries() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


# wide enough that `tic --help` shows each command's first sentence whole
@click.group(epilog=EXIT_CODES, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 120})
@click.version_option(tic.__version__, prog_name="tic")
def cli():
    """tic: train-inference consistency gates C0-C10 (rollout and training must give bitwise-identical
    logprobs for every sampled token)."""
    _quiet_libraries()


@cli.command(epilog=EXIT_CODES)
@click.argument("gate_id")
@CONFIG_OPT
@JSON_OPT
@JUNIT_OPT
def gate(gate_id, config_path, as_json, junit):
    """Run one gate (`tic gate C5`) and record its result in the state folder (.tic/ beside tic.yaml)."""
    from tic.gates import get
    from tic.skill import report
    from tic.skill.runner import run_gate, validate_run

    g = get(gate_id)
    ctx = _context(config_path)
    validate_run(ctx, [g], {"--junit": junit})
    with _stdout_reserved(as_json), report.progress(f"running {g.id} ...", as_json):
        res = run_gate(g, ctx)
    _finish([res], as_json, junit, f"tic gate {g.id}")


@cli.command(epilog=EXIT_CODES)
@CONFIG_OPT
@click.option("--from", "start", default="C0", show_default=True, help="first gate")
@click.option("--to", "stop", default="C10", show_default=True, help="last gate")
@click.option("--keep-going", is_flag=True, help="run later gates even after a failure")
@JSON_OPT
@JUNIT_OPT
def ladder(config_path, start, stop, keep_going, as_json, junit):
    """Climb the ladder in order; a failure stops the climb unless --keep-going (a waiting C1 does not)."""
    from tic.gates import gate_range
    from tic.skill import report
    from tic.skill.runner import run_ladder, validate_run

    gates = gate_range(start, stop)  # validate the range before touching anything
    ctx = _context(config_path)
    validate_run(ctx, gates, {"--junit": junit})  # every input those gates read; no output on an input
    con = report.console()

    con.print(f"tic ladder {start}..{stop} on {config_path or 'tic.yaml'}")
    ids = [g.id for g in gates]
    with _stdout_reserved(as_json), report.progress(f"running {ids[0]} ...", as_json, con) as spinner:
        def progress(r):
            con.print(f"  {r.gate:<4} {r.verdict:<11} {r.key_figure}")
            if r.gate != ids[-1]:
                spinner.update(f"running {ids[ids.index(r.gate) + 1]} ...")

        results = run_ladder(ctx, start, stop, keep_going, on_result=progress, validate=False)
    _finish(results, as_json, junit, f"tic ladder ({config_path or 'tic.yaml'})")


@cli.command(epilog=EXIT_CODES)
@CONFIG_OPT
@JSON_OPT
def status(config_path, as_json):
    """Show the recorded ladder: verdict, key figure, age, and whether the config, the model or another input
    (prompts file, dumps, the cut: by content) changed since. Reads only; writes nothing."""
    from tic.gates import REGISTRY
    from tic.harness.model.generate import has_weights, model_hash
    from tic.skill import report
    from tic.config.schema import load_config
    from tic.skill.fingerprint import input_hashes, reads_of
    from tic.skill.state import UNREADABLE, LadderState

    spinner = ExitStack()  # closed before the table prints
    spinner.enter_context(report.progress("reading the records and hashing their inputs ...", as_json))
    cfg = load_config(config_path)
    state = LadderState(cfg.state_path)
    recs = state.all()
    chash = cfg.config_hash()
    mhash = None
    try:
        from tic.harness.model.generate import resolve_model_dir

        src = cfg.resolve(cfg.model.path) if cfg.model is not None else None
        if src is not None and src.is_dir() and (has_weights(src) or cfg.model.generate is not None):
            weights = resolve_model_dir(cfg, generate=False)  # writes nothing: not generated yet, no hash
            mhash = model_hash(weights) if weights is not None else None
    except TicInputError:
        mhash = None
    rows, out = [], []
    for g in REGISTRY:
        r = recs.get(g.id)
        stale = ""
        if r == UNREADABLE:
            rows.append((g.id, g.title, r, ""))
            out.append({"gate": g.id, "verdict": UNREADABLE, "key_figure": "", "age_s": None, "stale": None})
            continue
        if r is not None:
            why = []
            if r.config_hash != chash:
                why.append("config changed")
            if r.model_hash and mhash and r.model_hash != mhash:
                why.append("model changed")
            now = input_hashes(cfg, reads_of(g))
            changed = sorted(k for k in set(r.inputs) | set(now) if r.inputs.get(k) != now.get(k))
            if changed:
                why.append(f"inputs changed ({', '.join(changed)})")
            stale = ", ".join(why) or "no"
        rows.append((g.id, g.title, r, stale))
        out.append({"gate": g.id, "verdict": r.verdict if r else "not run", "key_figure": r.key_figure if r else "",
                    "age_s": round(r.age_s()) if r else None, "stale": stale or None})
    spinner.close()
    report.console().print(report.status_table(rows))
    if as_json:
        report.print_json({"config_hash": chash, "model_hash": mhash, "gates": out})


@cli.command()
@click.argument("gate_id")
@JSON_OPT
def explain(gate_id, as_json):
    """What a gate measures, its exact pass condition (words and code), its inputs and its guide."""
    from tic.gates import get
    from tic.skill import report

    g = get(gate_id)
    guide = Path(tic.__file__).parent / g.guide
    if as_json:
        report.print_json({"gate": g.id, "title": g.title, "step": g.step, "measures": g.measures,
                           "pass_condition": g.pass_condition, "implemented_by": g.implemented_by,
                           "pass_condition_code": None if g.implemented_by else inspect.getsource(g.judge),
                           "inputs": list(g.inputs), "artifacts": list(g.artifacts), "guide": str(guide)})
        return
    con = report.console()
    con.print(f"[bold]{g.id} — {g.title}[/] (step {g.step})")
    con.print(f"\n[bold]Measures[/]: {g.measures}")
    con.print(f"[bold]Passes when[/]: {g.pass_condition}")
    if g.implemented_by:
        con.print(f"[yellow]unavailable: implemented by a later release ({g.implemented_by})[/]")
    else:
        con.print("[bold]Pass condition as code[/]:")
        con.print(textwrap.indent(inspect.getsource(g.judge), "    "), markup=False)
    if g.inputs:
        con.print(f"[bold]Inputs[/]: {', '.join(g.inputs)}")
    if g.artifacts:
        con.print(f"[bold]Artifacts[/]: {', '.join(g.artifacts)}")
    con.print(f"[bold]Guide[/]: {guide}")
    if guide.is_file():
        con.print("")
        con.print(guide.read_text(), markup=False)


@cli.command(epilog=EXIT_CODES)
@click.argument("rollout", type=click.Path(path_type=Path))
@click.argument("train", type=click.Path(path_type=Path))
@JSON_OPT
def compare(rollout, train, as_json):
    """Compare two dump files (JSONL: prompt_ids, response_ids, logprobs[, mask, weight_version, id]) with
    C5's metric and pass condition. Nothing is written to .tic/."""
    from tic.gates import get
    from tic.skill import report
    from tic.config.schema import parse_config
    from tic.skill.context import GateContext
    from tic.skill.runner import exit_code, run_gate

    # C5 itself, on a dump-only config: one metric, one pass condition, whichever way dumps arrive.
    cfg = parse_config({"rollout": {"engine": "dump", "dump": str(rollout.resolve())},
                        "train": {"engine": "dump", "dump": str(train.resolve())},
                        "locate": {"enabled": False}}, Path.cwd(), "tic compare")
    with report.progress("comparing the dumps ...", as_json):
        res = run_gate(get("C5"), GateContext(cfg), save=False)
    res.gate, res.title = "compare", f"{rollout} vs {train}"
    res.evidence = [str(rollout), str(train)]
    report.console().print(report.ladder_table([res], "tic compare"))
    if as_json:
        report.print_json(res.model_dump(mode="json"))
    sys.exit(exit_code([res]))


@cli.group()
def skill():
    """The agent skill (SKILL.md, guides, examples) that drives tic."""


@skill.command("install", epilog="""\b
Examples:
  tic skill install --target claude --project   # ./.claude/skills/train-inference-consistency
  tic skill install --target agents --user      # ~/.agents/skills/train-inference-consistency
  tic skill install --dir /some/skills --dry-run""")
@click.option("--dir", "dir_", type=click.Path(file_okay=False, path_type=Path),
              help="folder that holds skill folders (the skill goes into DIR/train-inference-consistency)")
@click.option("--target", type=click.Choice(["claude", "agents"]),
              help="claude: .claude/skills; agents: .agents/skills")
@click.option("--project/--user", "project", default=True, show_default=True,
              help="under the working directory or under your home directory")
@click.option("--dry-run", is_flag=True, help="list what would be written or removed; write nothing")
@JSON_OPT
def skill_install(dir_, target, project, dry_run, as_json):
    """Install the skill into an agent's skills folder (idempotent: unchanged files are not rewritten, files a
    previous version shipped and this one does not are removed)."""
    from tic.skill import report
    from tic.skill.skill_install import apply_install, plan_install, skills_parent

    if dir_ is not None and target is not None:
        raise TicInputError("give either --dir or --target, not both")
    plan = plan_install(skills_parent(target, not project, dir_, Path.cwd(), Path.home()))
    if not dry_run:
        apply_install(plan)
    con = report.console()
    if dry_run:
        for rel in plan.write:
            con.print(f"  would write {rel}", markup=False)
        for rel in plan.remove:
            con.print(f"  would remove {rel}", markup=False)
    done = ("to write", "to remove") if dry_run else ("written", "removed")
    con.print(f"{plan.dest}: {len(plan.files)} files; {len(plan.write)} {done[0]}, {len(plan.remove)} {done[1]}, "
              f"{len(plan.unchanged)} unchanged" + (" (dry run: nothing written)" if dry_run else ""), markup=False)
    if as_json:
        report.print_json({"path": str(plan.dest), "files": plan.files, "write": plan.write,
                           "remove": plan.remove, "dry_run": dry_run})


# Commands that live in their own modules (declared here, loaded when present).
EXTRA_COMMANDS = ("tic.skill.cut_cmd", "tic.skill.locate_cmd", "tic.skill.patch_cmd", "tic.skill.baseline_cmd")
for _mod in EXTRA_COMMANDS:
    try:
        _m = importlib.import_module(_mod)
    except ModuleNotFoundError as _e:
        if _e.name != _mod:
            raise
        continue
    cli.add_command(_m.command)


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM as Ctrl-C: `finally` blocks run, so no half-written file survives


def main(argv=None) -> None:
    in_main_thread = threading.current_thread() is threading.main_thread()  # only there can a handler be set
    previous = signal.signal(signal.SIGTERM, _interrupt) if in_main_thread else None
    try:
        cli.main(args=argv, standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:  # a usage error too: one line, like every other bad input
        message = " ".join(line.strip() for line in e.format_message().splitlines() if line.strip())
        click.echo(f"tic: error: {message}", err=True)
        sys.exit(EXIT_INPUT)
    except click.exceptions.Abort:
        sys.exit(EXIT_INPUT)
    except TicInputError as e:
        message = " ".join(line.strip() for line in str(e).splitlines() if line.strip())  # one line, always
        click.echo(f"tic: error: {message}", err=True)
        sys.exit(EXIT_INPUT)
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001
        click.echo(f"tic: internal error: {type(e).__name__}: {e}", err=True)
        if os.environ.get("TIC_DEBUG"):
            raise
        sys.exit(EXIT_INTERNAL)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    main()
