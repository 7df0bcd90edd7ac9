"""`tic skill install`: copy the skill (SKILL.md, its guides and every file they link to) into an agent's
skills folder, under a folder named after the skill, as the Agent Skills format requires.

The files come from the installed tic package, whose layout mirrors the repository (SKILL.md beside guides/
and examples/), so a relative link resolves the same way in the repository, in the wheel and in the
installed skill. What ships is SKILL.md, every guide, and the closure of their relative links.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from tic.core.errors import TicInputError
from tic.core.fsio import atomic_write_bytes

SKILL_NAME = "train-inference-consistency"
SKILL_FILE = "SKILL.md"
# Where agents look for skills: (target, scope) -> folder holding one subfolder per skill.
TARGET_DIRS = {"claude": ".claude/skills", "agents": ".agents/skills"}

# [text](target) or [text](target "title"); images too. Targets with a scheme or only an anchor are not files.
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_EXTERNAL = re.compile(r"^(?:[a-zA-Z][a-zA-Z0-9+.-]*:|#)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def package_root() -> Path:
    """The installed tic package (this file is tic/skill/skill_install.py)."""
    return Path(__file__).resolve().parent.parent


def local_links(markdown: str) -> list[str]:
    """Relative link targets of a markdown text (anchors dropped; code blocks and external links ignored)."""
    text = _FENCE.sub("", markdown)
    out = []
    for target in _LINK.findall(text):
        if _EXTERNAL.match(target):
            continue
        path = target.split("#", 1)[0]
        if path:
            out.append(path)
    return out


def skill_files(root: Path | None = None) -> list[str]:
    """Paths (relative to root, posix) of the skill: SKILL.md, every guide, and every file they link to,
    transitively through linked markdown. A link that leaves root, names a missing file, or names a folder
    that no shipped file is in, is an error."""
    root = (root or package_root()).resolve()
    seeds = [SKILL_FILE] + sorted(p.relative_to(root).as_posix() for p in (root / "guides").rglob("*.md"))
    seen: set[str] = set()
    folders: dict[str, str] = {}
    todo = list(seeds)
    while todo:
        rel = todo.pop()
        if rel in seen:
            continue
        path = root / rel
        if not path.is_file():
            raise TicInputError(f"skill file missing from the package: {rel}")
        seen.add(rel)
        if path.suffix != ".md":
            continue
        for link in local_links(path.read_text()):
            target = (path.parent / link).resolve()
            try:
                target_rel = target.relative_to(root).as_posix()
            except ValueError:
                raise TicInputError(f"{rel}: link {link!r} leaves the skill folder") from None
            if target.is_dir():  # resolves in the installed skill only if a shipped file lives in it
                folders.setdefault(target_rel, f"{rel}: link {link!r}")
                continue
            if not target.is_file():
                raise TicInputError(f"{rel}: link {link!r} names a missing file")
            todo.append(target_rel)
    for folder, where in folders.items():
        if not any(f.startswith(folder.rstrip("/") + "/") for f in seen):
            raise TicInputError(f"{where} names a folder no shipped file is in")
    return sorted(seen)


def skills_parent(target: str | None, user: bool, dir_: Path | None, cwd: Path, home: Path) -> Path:
    """The folder that holds skill folders: --dir as given, else the target's folder in the project or home."""
    if dir_ is not None:
        return Path(dir_).expanduser()
    if target is None:
        raise TicInputError("say where to install: --target claude|agents (with --project or --user) or --dir DIR")
    return (home if user else cwd) / TARGET_DIRS[target]


@dataclass
class InstallPlan:
    dest: Path
    files: list[str]
    write: list[str] = field(default_factory=list)
    remove: list[str] = field(default_factory=list)

    @property
    def unchanged(self) -> list[str]:
        return [f for f in self.files if f not in self.write]


def _owned(dest: Path) -> bool:
    """An existing folder is replaced only if it holds this skill (its SKILL.md names it)."""
    skill_md = dest / SKILL_FILE
    if not skill_md.is_file():
        return not any(dest.iterdir())
    head = skill_md.read_text(errors="replace").split("---", 2)
    return len(head) == 3 and re.search(rf"(?m)^name:\s*{re.escape(SKILL_NAME)}\s*$", head[1]) is not None


def plan_install(parent: Path, root: Path | None = None) -> InstallPlan:
    root = (root or package_root()).resolve()
    dest = Path(parent) / SKILL_NAME
    files = skill_files(root)
    plan = InstallPlan(dest=dest, files=files)
    if dest.exists():
        if not dest.is_dir():
            raise TicInputError(f"{dest} exists and is not a folder")
        if not _owned(dest):
            raise TicInputError(f"{dest} holds something other than the {SKILL_NAME} skill; not overwriting it")
        present = {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()}
        plan.remove = sorted(present - set(files))
    for rel in files:
        old = dest / rel
        if not old.is_file() or old.read_bytes() != (root / rel).read_bytes():
            plan.write.append(rel)
    return plan


def apply_install(plan: InstallPlan, root: Path | None = None) -> None:
    """Write what changed (each file atomically), then drop files a previous version shipped and this one not."""
    root = (root or package_root()).resolve()
    for rel in plan.write:
        atomic_write_bytes(plan.dest / rel, (root / rel).read_bytes())
    for rel in plan.remove:
        (plan.dest / rel).unlink()
    for d in sorted((p for p in plan.dest.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        if not any(d.iterdir()):
            d.rmdir()
