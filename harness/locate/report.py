"""The locator's report: a finding (tic.harness.locate.search.Finding) rendered as locate.json, a per-stage chart
and report.md beside the repro, and as the summary a gate's record keeps."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, StrictUndefined

from tic.core.fsio import atomic_write_bytes, atomic_write_text

TEMPLATES = Path(__file__).parent / "templates"
NO_CHART = "no chart: matplotlib is not installed (`pip install 'tic-consistency[chart]'`)"

# what a gate's record keeps of a finding (details.locate)
GATE_KEYS = ("status", "first_divergent_layer", "culprit_module", "first_operator", "operator_args",
             "traced_position", "reproduced_gate_values", "forward_passes", "seconds", "report", "repro", "chart",
             "repro_check", "repro_proves", "difference", "implementations", "recording_errors", "run_changes")


def _short(name: str) -> str:
    return name.replace("model.layers.", "L").replace("model.", "")


def record(finding) -> dict:
    """The finding as plain JSON values (the shape of locate.json, less the report's own paths)."""
    return dataclasses.asdict(finding)


def write(finding, out_dir: Path) -> dict:
    """Write divergence.png, report.md and locate.json into out_dir; the record as written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = record(finding)
    out["chart"] = write_chart(out_dir / "divergence.png", out["layers"], out["gate"])
    if not out["chart"]:
        out["chart_note"] = NO_CHART
    out["report"] = str(out_dir / "report.md")
    atomic_write_text(out_dir / "locate.json", json.dumps(out, indent=2, default=str))
    atomic_write_text(Path(out["report"]), render_report(out))
    return out


def gate_summary(out: dict) -> dict:
    """What a gate's record keeps of a written finding: its answer, the files, per stage whether it differs."""
    res = {k: out.get(k) for k in GATE_KEYS}
    res["layers"] = [{k: r[k] for k in ("stage", "equal", "differing_positions", "max_ulp", "first_divergent")}
                     for r in out["layers"]]
    res["module_trail"] = [d["module"] for d in out["module_trail"]]
    return res


def write_chart(path: Path, table: list[dict], gate: str) -> str:
    """The per-stage bar chart (max ulp distance; red: the first divergent stage, green: bitwise equal); "" when
    matplotlib (the `chart` extra) is not installed: the table in report.md says the same."""
    try:
        import matplotlib
    except ImportError:
        return ""

    matplotlib.use("Agg")
    import io

    import matplotlib.pyplot as plt

    labels = [_short(r["stage"]) for r in table]
    vals = [r["max_ulp"] for r in table]
    colors = ["#c0392b" if r["first_divergent"] else ("#e67e22" if not r["equal"] else "#27ae60") for r in table]
    fig, ax = plt.subplots(figsize=(max(5, 0.6 * len(labels) + 2), 3.2))
    # equal stages get a token bar so that "bitwise equal" is visible, not an empty slot
    ax.bar(range(len(labels)), [v if v > 0 else (0.3 if r["equal"] else 0) for v, r in zip(vals, table)],
           color=colors)
    ax.set_yscale("symlog", linthresh=1)
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right")
    ax.set_ylabel("max ulp distance")
    ax.set_title(f"{gate}: per-stage divergence (red = first divergent, green = bitwise equal)", fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return str(path)


def render_report(out: dict) -> str:
    """report.md from a finding's record."""
    env = Environment(loader=FileSystemLoader(str(TEMPLATES)), undefined=StrictUndefined, keep_trailing_newline=True)
    return env.get_template("report.md.j2").render(r=out, short=_short, Path=Path)
