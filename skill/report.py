"""Reports: rich tables on stderr, JSON on stdout, JUnit XML to a file."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from xml.etree import ElementTree as ET

from rich.console import Console
from rich.table import Table

from tic.gates.base import Verdict
from tic.skill.records import GateResult
from tic.core.fsio import atomic_write_text

STYLE = {Verdict.PASS: "bold green", Verdict.FAIL: "bold red", Verdict.ERROR: "bold magenta",
         Verdict.UNAVAILABLE: "yellow", Verdict.SKIPPED: "dim", Verdict.WAITING: "cyan"}
NOT_A_RESULT = (Verdict.UNAVAILABLE, Verdict.SKIPPED, Verdict.WAITING)  # JUnit's "skipped": nothing was compared


def console() -> Console:
    c = Console(stderr=True, no_color=bool(os.environ.get("NO_COLOR")), highlight=False)
    if not c.is_terminal:  # logs and CI: wide enough that reasons stay on one line
        c = Console(stderr=True, no_color=bool(os.environ.get("NO_COLOR")), highlight=False, width=200)
    return c


def ladder_table(results: list[GateResult], title: str = "tic ladder") -> Table:
    t = Table(title=title, title_justify="left")
    for col in ("gate", "title", "verdict", "key figure", "reason"):
        t.add_column(col, overflow="fold")
    for r in results:
        t.add_row(r.gate, r.title, f"[{STYLE.get(r.verdict, '')}]{r.verdict}[/]", r.key_figure, r.reason)
    return t


def _age(seconds: float) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= n:
            return f"{int(seconds // n)}{unit}"
    return f"{int(seconds)}s"


def status_table(rows: list[tuple[str, str, GateResult | str | None, str]]) -> Table:
    t = Table(title="tic status", title_justify="left")
    for col in ("gate", "title", "verdict", "key figure", "age", "stale?"):
        t.add_column(col, overflow="fold")
    for gid, title, r, stale in rows:
        if r is None:
            t.add_row(gid, title, "[dim]not run[/]", "", "", "")
        elif isinstance(r, str):  # a record file that is not a valid record: shown, never counted as a pass
            t.add_row(gid, title, f"[red]{r}[/]", "", "", "")
        else:
            t.add_row(gid, title, f"[{STYLE.get(r.verdict, '')}]{r.verdict}[/]", r.key_figure, _age(r.age_s()), stale)
    return t


def progress(text: str, as_json: bool = False, con: Console | None = None):
    """A spinner on stderr while a step runs (`with progress(...) as p: p.update(...)`); nothing with --json or
    when stderr is not a terminal (logs and CI get the result lines only)."""
    con = con or console()  # the console that prints meanwhile, so its lines go above the spinner
    if as_json or not con.is_terminal:
        return _NoProgress()
    return con.status(text)


class _NoProgress(contextlib.nullcontext):
    def __enter__(self):
        return self

    def update(self, *args, **kwargs) -> None:
        pass


def print_json(payload: dict) -> None:
    print(json.dumps(payload, indent=2, default=str))


def write_junit(path: Path, results: list[GateResult]) -> None:
    suite = ET.Element("testsuite", name="tic", tests=str(len(results)),
                       failures=str(sum(r.verdict == Verdict.FAIL for r in results)),
                       errors=str(sum(r.verdict == Verdict.ERROR for r in results)),
                       skipped=str(sum(r.verdict in NOT_A_RESULT for r in results)),
                       time=f"{sum(r.duration_s for r in results):.3f}")
    for r in results:
        case = ET.SubElement(suite, "testcase", classname="tic.ladder", name=f"{r.gate} {r.title}",
                             time=f"{r.duration_s:.3f}")
        if r.verdict == Verdict.FAIL:
            ET.SubElement(case, "failure", message=r.reason).text = json.dumps(r.metrics, default=str)
        elif r.verdict == Verdict.ERROR:
            ET.SubElement(case, "error", message=r.reason).text = r.details.get("traceback", "")
        elif r.verdict in NOT_A_RESULT:
            ET.SubElement(case, "skipped", message=r.reason)
    atomic_write_text(Path(path), ET.tostring(suite, encoding="unicode", xml_declaration=True))
