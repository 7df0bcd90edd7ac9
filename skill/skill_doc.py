"""SKILL.md's generated part: the ladder table, rendered from the gate registry (tic.gates.REGISTRY), so the
skill cannot name a gate, pass condition or guide that tic does not have.

    python -m tic.skill.skill_doc           # print the table
    python -m tic.skill.skill_doc --write   # replace it in SKILL.md (between the two markers)
"""

from __future__ import annotations

import sys

from tic.gates import REGISTRY
from tic.skill.skill_install import SKILL_FILE, package_root

BEGIN = "<!-- ladder table: generated from tic.gates.REGISTRY by `python -m tic.skill.skill_doc --write` -->"
END = "<!-- end of ladder table -->"
STEPS = {1: "target", 2: "small model, inference", 3: "training", 4: "RL, full model", 5: "performance"}


def ladder_table() -> str:
    rows = ["| gate | step | checks | passes when | in this release | guide |", "|---|---|---|---|---|---|"]
    for g in REGISTRY:
        status = "unavailable (never a pass)" if g.implemented_by else "measured"
        cond = g.pass_condition.replace("|", "\\|")
        rows.append(f"| {g.id} | {g.step} {STEPS.get(g.step, '')} | {g.title} | {cond} | {status} "
                    f"| [{g.guide}]({g.guide}) |")
    return "\n".join(rows)


def table_in(skill_md: str) -> str | None:
    """The table currently between the markers, or None when the markers are missing."""
    if BEGIN not in skill_md or END not in skill_md:
        return None
    return skill_md.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def with_table(skill_md: str) -> str:
    head, rest = skill_md.split(BEGIN, 1)
    return f"{head}{BEGIN}\n{ladder_table()}\n{END}{rest.split(END, 1)[1]}"


def main(argv: list[str]) -> int:
    if argv == ["--write"]:
        path = package_root() / SKILL_FILE
        text = path.read_text()
        if table_in(text) is None:
            print(f"{path}: markers missing", file=sys.stderr)
            return 2
        path.write_text(with_table(text))
        return 0
    print(ladder_table())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
