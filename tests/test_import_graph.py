"""The package's shape as docs/architecture.md states it: no import cycle between modules, no import from a
higher floor, nothing but the test-only package itself imports it, and no function of MAX_FUNCTION_LINES lines or
more. Imports are read with ast, at module level and inside functions alike. Each rule also fails a planted
offence in a throwaway package."""

from __future__ import annotations

import ast
import graphlib
import re
import textwrap
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ARCHITECTURE = REPO / "docs" / "architecture.md"
MAX_FUNCTION_LINES = 80  # every function is shorter than this


# --- the checker ---------------------------------------------------------------------------------------------
def package_modules(root: Path) -> dict[str, Path]:
    """Module name -> file, for every module of the packages pyproject.toml lists (package-dir maps tic to root)."""
    setup = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = setup.get("package-dir", {})
    modules = {}
    for package in setup["packages"]:
        top, *sub = package.split(".")
        folder = (root / dirs.get(top, top)).joinpath(*sub)
        for f in sorted(folder.glob("*.py")):
            modules[package if f.stem == "__init__" else f"{package}.{f.stem}"] = f
    return modules


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that module `name` imports anywhere in its file (top level or inside a function);
    `from P import x` counts as importing P, and P.x too when that is a module."""
    parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package, one level up per extra dot
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    known = set(modules)
    return {name: imported_modules(name, path, known) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per break needed: find a cycle, record it, drop its first edge, look again."""
    graph = {k: set(v) for k, v in graph.items()}
    found = []
    while True:
        try:
            graphlib.TopologicalSorter(graph).prepare()
            return found
        except graphlib.CycleError as e:
            cycle = list(reversed(e.args[1]))  # graphlib lists it against the edges; read it as "a imports b"
            found.append(cycle)
            graph[cycle[0]].discard(cycle[1])


@dataclass(frozen=True)
class Floor:
    level: int
    test_only: bool  # imported by nothing outside its own package


def read_floors(text: str) -> dict[str, Floor]:
    """Package -> floor, from the table under '## Floors': rows `| N | `pkg` `pkg` | ... |`, where the floor cell
    may add 'test-only'."""
    section = text.split("\n## Floors\n", 1)[1].split("\n## ", 1)[0]
    floors = {}
    for line in section.splitlines():
        row = re.match(r"\|\s*(\d+)\s*(test-only)?\s*\|([^|]*)\|", line)
        if row:
            for package in re.findall(r"`(tic(?:\.\w+)*)`", row.group(3)):
                floors[package] = Floor(int(row.group(1)), bool(row.group(2)))
    return floors


def owner(module: str, floors: dict[str, Floor]) -> str:
    """The package of the floors table a module belongs to: the longest one that holds it ('tic' holds all)."""
    return max((p for p in floors if module == p or module.startswith(p + ".")), key=len)


def floor_violations(graph: dict[str, set[str]], floors: dict[str, Floor]) -> list[str]:
    out = []
    for a in sorted(graph):
        pa = owner(a, floors)
        for b in sorted(graph[a]):
            pb = owner(b, floors)
            if floors[pb].test_only and pb != pa:
                out.append(f"{a} imports {b}: {pb} is test-only")
            elif floors[pb].level > floors[pa].level:
                out.append(f"{a} (floor {floors[pa].level}) imports {b} (floor {floors[pb].level})")
    return out


def long_functions(modules: dict[str, Path], limit: int = MAX_FUNCTION_LINES) -> list[tuple[int, str]]:
    """(lines, 'module:function') of every function or method of `limit` lines or more, longest first."""
    out = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines >= limit:
                    out.append((lines, f"{name}:{node.name}"))
    return sorted(out, reverse=True)


FLOORS = read_floors(ARCHITECTURE.read_text())
MODULES = package_modules(REPO)


# --- the package ---------------------------------------------------------------------------------------------
def test_every_module_has_a_floor():
    """A new subpackage needs a row: only the root module and harness's own __init__ fall to the row of 'tic'."""
    assert FLOORS["tic"].level == 0
    assert {n for n in MODULES if owner(n, FLOORS) == "tic"} == {"tic", "tic.harness"}


def test_no_import_cycle():
    found = cycles(import_graph(MODULES))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_upward_import():
    bad = floor_violations(import_graph(MODULES), FLOORS)
    assert not bad, "imports against docs/architecture.md's floors:\n" + "\n".join(bad)


def test_every_function_is_shorter_than_the_limit():
    assert not long_functions(MODULES), long_functions(MODULES)


# --- planted offences ------------------------------------------------------------------------------------------
def plant(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    """A throwaway package tree: relative path -> source; returns its modules as package_modules would."""
    modules = {}
    for rel, source in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(source))
        parts = list(Path(rel).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return modules


def test_a_planted_cycle_through_a_function_local_import_fails(tmp_path):
    files = {"tic/__init__.py": "", "tic/core/__init__.py": "", "tic/core/a.py": "from tic.core import b\n",
             "tic/core/b.py": "def f():\n    from tic.core.a import x\n"}
    assert cycles(import_graph(plant(tmp_path / "1", files))) == [["tic.core.a", "tic.core.b", "tic.core.a"]]
    files["tic/core/b.py"] = "def f():\n    import tic.core\n"  # the package's __init__, not a: no cycle
    assert cycles(import_graph(plant(tmp_path / "2", files))) == []


def test_a_planted_upward_import_fails(tmp_path):
    modules = plant(tmp_path, {"tic/__init__.py": "", "tic/skill/__init__.py": "", "tic/skill/cli.py": "",
                               "tic/harness/__init__.py": "", "tic/harness/engines/__init__.py": "",
                               "tic/harness/engines/hf.py": "def build(ctx):\n"
                                                            "    from ...skill.cli import main\n",
                               "tic/harness/engines/ok.py": "from tic.harness.engines import hf\nimport tic\n"})
    assert floor_violations(import_graph(modules), FLOORS) == [
        f"tic.harness.engines.hf (floor {FLOORS['tic.harness.engines'].level}) imports tic.skill.cli "
        f"(floor {FLOORS['tic.skill'].level})"]


def test_a_planted_import_of_the_test_only_package_fails(tmp_path):
    modules = plant(tmp_path, {"tic/__init__.py": "", "tic/gates/__init__.py": "",
                               "tic/gates/c5.py": "from tic.harness.testing.plants import plant\n",
                               "tic/harness/testing/__init__.py": "", "tic/harness/testing/plants.py": "",
                               "tic/harness/testing/tiny.py": "from . import plants\n"})
    assert floor_violations(import_graph(modules), FLOORS) == [
        "tic.gates.c5 imports tic.harness.testing.plants: tic.harness.testing is test-only"]


def test_a_planted_long_function_fails(tmp_path):
    long = "def long():\n" + "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))
    short = "class C:\n    def short(self):\n" + "".join(f"        y{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 2))
    assert long_functions(plant(tmp_path, {"tic/m.py": long + short})) == [(MAX_FUNCTION_LINES, "tic.m:long")]
