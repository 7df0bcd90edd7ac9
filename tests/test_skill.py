"""The skill as a product: SKILL.md's frontmatter against the Agent Skills spec, `tic skill install` (validator,
links, idempotence, the wheel's contents: results documents, never their raw data), every repository path the
documents quote exists, every `tic ...` command the skill quotes parses against the real CLI, the ladder table
matches the gate registry, and SKILL.md's walkthrough runs to C5 passing."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import unicodedata
import zipfile
from pathlib import Path

import click
import pytest
import yaml

from tic.harness.engines import hf
from tic.skill import skill_doc
from tic.skill.skill_install import (SKILL_NAME, apply_install, local_links, plan_install, skill_files,
                                     skills_parent)

REPO = Path(__file__).resolve().parent.parent
SKILL_MD = REPO / "SKILL.md"
RESULTS = REPO / "docs" / "results"

# --- the Agent Skills spec (https://agentskills.io/specification), as skills-ref 0.1 checks it -----------------
ALLOWED_FIELDS = {"name", "description", "license", "allowed-tools", "metadata", "compatibility"}


def spec_errors(skill_dir: Path) -> list[str]:
    """The validator's rules, for environments without skills-ref: fields, name format and folder, lengths."""
    text = (skill_dir / "SKILL.md").read_text()
    if not text.startswith("---") or len(text.split("---", 2)) < 3:
        return ["no frontmatter"]
    meta = yaml.safe_load(text.split("---", 2)[1])
    errors = []
    if not isinstance(meta, dict):
        return ["frontmatter is not a mapping"]
    if set(meta) - ALLOWED_FIELDS:
        errors.append(f"unexpected fields {sorted(set(meta) - ALLOWED_FIELDS)}")
    name = meta.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", name) or len(name) > 64:
        errors.append(f"bad name {name!r}")
    elif unicodedata.normalize("NFKC", skill_dir.name) != name:
        errors.append(f"folder {skill_dir.name!r} is not named {name!r}")
    desc = meta.get("description")
    if not isinstance(desc, str) or not desc.strip() or len(desc) > 1024:
        errors.append("description missing or over 1024 characters")
    comp = meta.get("compatibility")
    if comp is not None and (not isinstance(comp, str) or len(comp) > 500):
        errors.append("compatibility not a string of at most 500 characters")
    md = meta.get("metadata")
    if md is not None and not (isinstance(md, dict) and all(isinstance(v, str) for v in md.values())):
        errors.append("metadata must map strings to strings")
    return errors


def validate(skill_dir: Path) -> list[str]:
    errors = spec_errors(skill_dir)
    try:
        from skills_ref.validator import validate as ref_validate
    except ImportError:
        return errors
    return errors + ref_validate(skill_dir)


def frontmatter(path: Path = SKILL_MD) -> dict:
    return yaml.safe_load(path.read_text().split("---", 2)[1])


def test_frontmatter_follows_the_spec():
    meta = frontmatter()
    assert meta["name"] == SKILL_NAME
    assert {"name", "description", "license", "compatibility"} <= set(meta)
    desc = meta["description"]
    # third person: starts with a verb in -s form, never addresses the reader or speaks as "I"
    assert re.match(r"^[A-Z][a-z]+s\b", desc), desc[:40]
    assert not re.search(r"\b(you|your|I|we)\b", desc), desc
    assert "Use when" in desc  # says when to load it
    import tic

    assert meta["metadata"]["tic-version"] == tic.__version__


def test_spec_rules_catch_a_wrong_folder_and_bad_fields(tmp_path):
    bad = tmp_path / "skill"  # not the skill's name
    bad.mkdir()
    (bad / "SKILL.md").write_text(f"---\nname: {SKILL_NAME}\ndescription: x\nversion: 1\n---\nbody\n")
    errors = validate(bad)
    assert any("folder" in e or "must match" in e for e in errors)
    assert any("version" in e for e in errors)


def test_skill_body_links_not_backticked_paths():
    body = SKILL_MD.read_text().split("---", 2)[2]
    # a reference the agent should open is a link; a backticked guides/... or examples/... path is not
    assert not re.findall(r"`(?:guides|examples|docs)/[^`]*\.(?:md|yaml|py)`", body)
    assert "guides/C5.md" in local_links(body)


# --- links and what ships ------------------------------------------------------------------------------------
def test_every_link_resolves_in_the_repository():
    files = skill_files(REPO)  # raises on a missing or escaping link
    assert "SKILL.md" in files and "guides/ops/attention-prefill-decode.md" in files
    assert "examples/tiny-qwen3/tic.yaml" in files and "examples/tiny-qwen3/config.json" in files


def test_the_skill_ships_no_results_records():
    """The GPU results records (docs/results/: documents, run logs) stay in the repository; the guides state the
    measured figures and name the record."""
    assert not [f for f in skill_files(REPO) if f.startswith("docs/")]


def test_results_documents_link_documents_and_name_raw_data_that_exists():
    """One document per capability, its raw data in the folder of its name: a document links only other results
    documents (so whatever a guide links installs without run logs), names its raw files as paths that exist, and
    no raw-data folder is without its document."""
    docs = sorted(RESULTS.glob("*.md"))
    stems = {d.stem for d in docs}
    assert {p.name for p in RESULTS.iterdir() if p.is_dir()} <= stems
    for d in docs:
        text = d.read_text()
        for link in local_links(text):
            assert re.fullmatch(r"[\w.-]+\.md", link) and (RESULTS / link).is_file(), f"{d.name}: link {link}"
        for span in re.findall(r"`([^`\s]+)`", re.sub(r"(?ms)^```.*?^```", "", text)):
            if span.split("/")[0] not in stems or "/" not in span or "<" in span:
                continue
            hits = list(RESULTS.glob(span.rstrip("/"))) if "*" in span else [RESULTS / span]
            assert hits and all(h.exists() for h in hits), f"{d.name}: `{span}` does not exist"


# Paths the documents quote: a folder of the repository, then a path (links are checked by skill_files).
QUOTED_PATH = re.compile(r"(?<![\w/.$-])((?:benchmarks|docs|examples|tests|guides|harness|skill|gates|config|core|"
                         r"patches)/[\w.*/-]*[\w*/])")


def test_every_path_the_documents_quote_exists():
    docs = [REPO / "README.md", SKILL_MD, *sorted((REPO / "guides").rglob("*.md")), *sorted(RESULTS.glob("*.md")),
            REPO / "benchmarks" / "gpu" / "README.md"]
    missing = []
    for d in docs:
        for path in QUOTED_PATH.findall(d.read_text()):
            path = path.rstrip(".")
            if any(re.fullmatch(r"[A-Z_]+(\.\w+)?", part) for part in path.split("/")):
                continue  # a placeholder (benchmarks/gpu/NAME.py)
            if not (list(REPO.glob(path.rstrip("/"))) if "*" in path else (REPO / path).exists()):
                missing.append(f"{d.relative_to(REPO)}: {path}")
    assert missing == []


def test_every_path_a_shipped_guide_quotes_is_in_the_installed_skill(tmp_path):
    """SKILL.md and the guides, as installed: every repository path they quote (not only their links) is a file
    or folder of the installed skill, so an agent that reads it can open it."""
    plan = plan_install(tmp_path / "skills")
    apply_install(plan)
    guides = [plan.dest / "SKILL.md", *sorted((plan.dest / "guides").rglob("*.md"))]
    missing = []
    for d in guides:
        for path in QUOTED_PATH.findall(d.read_text()):
            path = path.rstrip(".")
            if any(re.fullmatch(r"[A-Z_]+(\.\w+)?", part) for part in path.split("/")):
                continue  # a placeholder (.tic/artifacts/CN/...)
            if not (list(plan.dest.glob(path.rstrip("/"))) if "*" in path else (plan.dest / path).exists()):
                missing.append(f"{d.relative_to(plan.dest)}: {path}")
    assert missing == []
    examples = {p.parent.name for p in (plan.dest / "examples").rglob("*.json")}
    assert all((plan.dest / "examples" / e / "tic.yaml").is_file() for e in examples), examples


def test_a_broken_link_is_reported(tmp_path):
    root = tmp_path / "pkg"
    (root / "guides").mkdir(parents=True)
    (root / "SKILL.md").write_text("---\nname: x\n---\nsee [the guide](guides/C5.md)\n")
    (root / "guides" / "C5.md").write_text("see [nowhere](ops/missing.md) and [web](https://example.org)\n")
    with pytest.raises(Exception, match="missing.md"):
        skill_files(root)


def test_every_gate_guide_links_an_operator_guide():
    ops = {p.name for p in (REPO / "guides" / "ops").glob("*.md")}
    linked = set()
    for g in (REPO / "guides").glob("C*.md"):
        linked |= {Path(x).name for x in local_links(g.read_text()) if "ops/" in x}
    assert ops <= linked, f"operator guides no gate guide links: {sorted(ops - linked)}"


def test_operator_guides_have_symptom_cause_fix_gate():
    for p in sorted((REPO / "guides" / "ops").glob("*.md")):
        text = p.read_text()
        for part in ("**Symptom", "**Cause", "**Fix", "**Proves it"):
            assert part in text, f"{p.name} lacks {part}"


def install_into(parent: Path) -> Path:
    plan = plan_install(parent)
    apply_install(plan)
    return plan.dest


def test_install_validates_resolves_and_is_idempotent(tmp_path):
    dest = install_into(tmp_path / "skills")
    assert dest.name == SKILL_NAME
    assert validate(dest) == []
    assert skill_files(dest) == skill_files(REPO)  # every link resolves inside the installed folder
    again = plan_install(tmp_path / "skills")
    assert again.write == [] and again.remove == []
    # a file an older version shipped is removed; an edited one is restored
    (dest / "guides" / "old.md").write_text("stale\n")
    (dest / "guides" / "C5.md").write_text("edited\n")
    plan = plan_install(tmp_path / "skills")
    assert plan.remove == ["guides/old.md"] and plan.write == ["guides/C5.md"]
    apply_install(plan)
    assert not (dest / "guides" / "old.md").exists()
    assert (dest / "guides" / "C5.md").read_bytes() == (REPO / "guides" / "C5.md").read_bytes()


def test_install_cli_targets_dry_run_and_foreign_folder(tmp_path, monkeypatch, tic):
    monkeypatch.chdir(tmp_path)
    code, _, err = tic("skill", "install", "--target", "claude", "--project", "--dry-run")
    assert code == 0 and "would write SKILL.md" in err and not (tmp_path / ".claude").exists()
    code, out, _ = tic("skill", "install", "--target", "agents", "--project", "--json")
    rec = json.loads(out)
    assert code == 0 and Path(rec["path"]) == tmp_path / ".agents" / "skills" / SKILL_NAME
    assert validate(Path(rec["path"])) == []
    assert skills_parent("claude", True, None, tmp_path, tmp_path / "home") == tmp_path / "home/.claude/skills"
    foreign = tmp_path / "other" / SKILL_NAME
    foreign.mkdir(parents=True)
    (foreign / "SKILL.md").write_text("---\nname: someone-else\ndescription: x\n---\n")
    code, _, err = tic("skill", "install", "--dir", str(tmp_path / "other"))
    assert code == 2 and "not overwriting" in err
    assert tic("skill", "install")[0] == 2  # neither --dir nor --target


@pytest.mark.slow
def test_the_wheel_ships_every_linked_file(tmp_path):
    """Build the wheel from a copy of the tree (pip, no dependencies, no isolation), unpack it, install the skill
    from the unpacked package: every linked file is there and the result validates."""
    src = tmp_path / "src"
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                            text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    for rel in listed.stdout.splitlines():
        if (REPO / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, src / rel)
    out = tmp_path / "wheel"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                        str(out), str(src)], capture_output=True, text=True)
    if r.returncode != 0 and "No module named pip" in r.stderr:
        pytest.skip("pip is not available")
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = out.glob("*.whl")
    unpacked = tmp_path / "site"
    zipfile.ZipFile(whl).extractall(unpacked)
    root = unpacked / "tic"
    assert skill_files(root) == skill_files(REPO)
    # no results record, run log or GPU benchmark ships
    assert not (root / "docs").exists() and not (root / "benchmarks").exists()
    plan = plan_install(tmp_path / "skills", root=root)
    apply_install(plan, root=root)
    assert validate(plan.dest) == []


# --- the ladder table and the quoted commands ---------------------------------------------------------------
def test_ladder_table_is_the_registry():
    current = skill_doc.table_in(SKILL_MD.read_text())
    assert current is not None, "SKILL.md lacks the ladder table markers"
    assert current == skill_doc.ladder_table(), "regenerate: python -m tic.skill.skill_doc --write"


# Placeholders the documents use, and a value of the right kind for each.
PLACEHOLDERS = {"CN": "C5", "NAME": "fa3-fixed-tile", "FULL_DIR": "full", "SMALL_DIR": "small", "DIR": "d",
                "MODEL_DIR": "m", "OUT_DIR": "o", "ROLLOUT.jsonl": "r.jsonl", "TRAIN.jsonl": "t.jsonl",
                "PATH": "p.yaml", "RESULTS_DIR": "res", "CONFIG...": "c"}
PENDING = {"patch"}  # `tic patch ...` lands with the bundled patches; checked as soon as the command exists


def quoted_commands() -> list[tuple[str, str]]:
    docs = [SKILL_MD, *sorted((REPO / "guides").rglob("*.md"))]
    found = []
    for p in docs:
        text = p.read_text()
        spans = re.findall(r"`(tic [^`]+)`", text)
        for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M):
            spans += [ln.split("#")[0].strip() for ln in block.splitlines() if ln.strip().startswith("tic ")]
        found += [(p.relative_to(REPO).as_posix(), s.strip()) for s in spans]
    return found


def parse_cli(argv: list[str]) -> None:
    """Parse argv against the real click tree down to the leaf command, without running anything. A bare
    command path (`tic gate` named in prose) only has to exist; anything with arguments must parse."""
    from tic.skill.cli import cli

    cmd, name, ctx = cli, "tic", None
    while True:
        if not argv and ctx is not None:
            return  # the command path exists; no arguments were quoted
        try:
            ctx = cmd.make_context(name, list(argv), parent=ctx)
        except click.exceptions.Exit as e:  # --help, --version
            assert e.exit_code == 0
            return
        if not isinstance(cmd, click.Group):
            return
        rest = [*ctx._protected_args, *ctx.args] if hasattr(ctx, "_protected_args") else [*ctx.protected_args,
                                                                                          *ctx.args]
        name, cmd, argv = cmd.resolve_command(ctx, rest)
        argv = list(argv)


def test_every_quoted_tic_command_parses():
    from tic.skill.cli import cli

    cmds = quoted_commands()
    assert len(cmds) > 20
    checked = 0
    for where, line in cmds:
        words = [PLACEHOLDERS.get(w, w) for w in shlex.split(line)[1:]]
        if words and words[0] in PENDING and words[0] not in cli.commands:
            continue
        try:
            parse_cli(words)
        except click.ClickException as e:
            pytest.fail(f"{where}: `{line}` does not parse: {e.format_message()}")
        checked += 1
    assert checked > 20


README = REPO / "README.md"


def readme_commands() -> tuple[list[str], list[str]]:
    """README.md's quoted tic commands: (concrete ones, synopses with [optional] parts or a|b choices)."""
    text = README.read_text()
    spans = re.findall(r"`(tic [^`]+)`", text)
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        for line in block.splitlines():
            spans += [p.split("#")[0].strip().removeprefix(".venv/bin/") for p in line.split("&&")
                      if p.strip().startswith((".venv/bin/tic ", "tic "))]
    synopses = [s for s in spans if "[" in s or "\\|" in s]
    return [s for s in spans if s not in synopses], synopses


def synopsis_errors(line: str) -> list[str]:
    """A synopsis names a command that exists and only options it (or one of its subcommands) takes."""
    from tic.skill.cli import cli

    words = [w.strip("[]") for w in line.replace("\\|", " ").split()[1:]]
    cmd, leaves = cli, [cli]
    while isinstance(cmd, click.Group) and words and words[0] in cmd.commands:
        # below the top: more than one named is a choice of subcommands (run|freeze)
        named = [w for w in words if w in cmd.commands] if cmd is not cli else words[:1]
        leaves = [cmd.commands[w] for w in named]
        words = [w for w in words if w not in named]
        if len(named) > 1:
            break
        cmd = leaves[0]
    if cmd is cli:
        return [f"`{line}`: no such command"]
    known = {o for c in leaves for p in c.params for o in [*p.opts, *p.secondary_opts]}
    return [f"`{line}`: {w} is not an option of `tic {' | '.join(c.name for c in leaves)}`" for w in words
            if w.startswith("-") and w.split("=")[0] not in known]


def test_every_readme_command_parses():
    concrete, synopses = readme_commands()
    assert len(concrete) > 8 and len(synopses) > 4
    assert any(c.startswith("tic ladder -c examples/tiny-qwen3/tic.yaml") for c in concrete)
    for line in concrete:
        words = [PLACEHOLDERS.get(w, w) for w in shlex.split(line)[1:]]
        try:
            parse_cli(words)
        except click.ClickException as e:
            pytest.fail(f"README.md: `{line}` does not parse: {e.format_message()}")
    assert [e for line in synopses for e in synopsis_errors(line)] == []


def test_readme_synopsis_check_catches_a_wrong_option():
    assert synopsis_errors("tic ladder -c tic.yaml [--form CN]")
    assert synopsis_errors("tic frobnicate [--to CN]")
    assert synopsis_errors("tic skill install --target claude\\|agents [--project\\|--user]") == []


def test_command_parser_rejects_a_wrong_command():
    with pytest.raises(click.ClickException):
        parse_cli(["ladder", "--form", "C3"])
    with pytest.raises(click.ClickException):
        parse_cli(["frobnicate"])


# --- the walkthrough ---------------------------------------------------------------------------------------------
def walkthrough_block() -> list[str]:
    text = SKILL_MD.read_text().split("## Walkthrough", 1)[1]
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [ln for ln in block.splitlines() if ln.strip()]


@pytest.mark.slow
def test_walkthrough_reaches_c5_pass(example, monkeypatch, tic):
    """Runs SKILL.md's walkthrough block line by line in a copy of the embedded example: each `tic` line must
    exit as its comment says, `cat` lines name files that exist, other lines run in the shell. Sizes are cut
    down (fewer prompts and tokens) to keep the test short; the commands are the document's."""
    hf._MODELS.clear()
    work = example("tiny-qwen3")
    cfg = work / "tic.yaml"
    cfg.write_text(cfg.read_text().replace("count: 8", "count: 3").replace("max_tokens: 16", "max_tokens: 6")
                   .replace("batch_sizes: [2, 5, 8]", "batch_sizes: [2]").replace("probes: 2", "probes: 1"))
    monkeypatch.chdir(work)
    lines = walkthrough_block()
    assert any("kernels: consistent" in ln for ln in lines)
    codes = []
    for ln in lines:
        cmd, _, comment = ln.partition("#")
        want = re.search(r"exit (\d)", comment)
        if cmd.startswith("tic "):
            code, out, err = tic(*shlex.split(cmd)[1:])
            codes.append(code)
            assert want is not None, f"walkthrough line without its exit code: {ln}"
            assert code == int(want.group(1)), f"{cmd}: exit {code}\n{err[-3000:]}"
            words = shlex.split(cmd)
            if words[1] == "gate" and code == 0:  # a passing gate leaves no report of an old failure behind
                assert not (work / ".tic" / "artifacts" / words[2] / "locate").exists(), cmd
        elif cmd.startswith("cat "):
            assert (work / cmd.split()[1]).is_file(), f"{cmd}: the file SKILL.md points to does not exist"
        else:
            subprocess.run(["bash", "-c", cmd], check=True, cwd=work)
    rec = json.loads((work / ".tic" / "results" / "C5.json").read_text())
    assert rec["verdict"] == "pass"
    assert not (work / ".tic" / "artifacts" / "C5" / "locate").exists()  # the old failure's report is gone
    assert codes.count(1) >= 1 and codes[-1] == 0
    hf._MODELS.clear()


# --- CLI behaviour the skill's loop relies on -------------------------------------------------------------------
def test_config_errors_list_every_error_with_allowed_values(example, workdir, tic):
    ex = example("tiny-qwen3")
    bad = ex / "bad.yaml"
    bad.write_text("model: {path: ., colour: red}\nrollout: {kernels: fast}\ntrain: {kernels: stok}\n")
    code, _, err = tic("gate", "C0", "-c", str(bad))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "3 errors" in err and "more)" not in err
    assert "model.colour: unknown key (allowed: path, dtype, generate)" in err
    assert "rollout.kernels: Input should be 'stock', 'consistent' or 'vllm' (got 'fast')" in err
    assert "train.kernels: Input should be 'stock', 'consistent' or 'vllm' (got 'stok')" in err
    assert "'stock', 'consistent' or 'vllm'" in err  # every allowed value


def test_status_finds_tic_yaml_here_or_says_so(example, monkeypatch, tic, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "tic-consistent.yaml").write_text("model: {path: .}\n")
    monkeypatch.chdir(empty)
    code, _, err = tic("status")
    assert code == 2 and "no tic.yaml in" in err and "-c" in err and "tic-consistent.yaml" in err
    ex = example("tiny-qwen3")
    monkeypatch.chdir(ex)
    code, _, err = tic("status")
    assert code == 0 and "C5" in err


def test_state_dir_is_beside_tic_yaml(example, workdir, tic):
    ex = example("tiny-qwen3")
    assert tic("gate", "C0", "-c", str(ex / "tic.yaml"))[0] == 0
    assert (ex / ".tic" / "results" / "C0.json").is_file()
    assert not (workdir / ".tic").exists()  # not where the command ran


def test_ladder_hint_only_when_unavailable_gates_alone_keep_exit_1():
    from tic.skill.records import GateResult
    from tic.skill.runner import unavailable_hint

    def res(gate, verdict):
        return GateResult(gate=gate, title=gate, verdict=verdict)

    ok = [res("C0", "pass"), res("C1", "unavailable"), res("C2", "pass"), res("C3", "pass"),
          res("C7", "unavailable")]
    hint = unavailable_hint(ok)
    assert "C1, C7 are unavailable" in hint and "tic ladder --from C2 --to C3" in hint
    assert "--from C0 --to C0" in hint
    assert unavailable_hint([*ok[:3], res("C3", "fail"), res("C7", "unavailable")]) is None
    assert unavailable_hint([res("C3", "pass"), res("C4", "pass")]) is None
    assert unavailable_hint([res("C3", "error"), res("C7", "unavailable")]) is None


def test_cut_on_a_generated_model(example, monkeypatch, tic):
    ex = example("tiny-qwen3")  # config.json only; tic.yaml generates the weights
    monkeypatch.chdir(ex)
    code, _, err = tic("cut", ".", "small")
    assert code == 0, err
    assert (ex / "small" / "cut.json").is_file() and any((ex / "small").glob("*.safetensors"))
    monkeypatch.chdir(ex.parent)  # no tic.yaml here: say what to do
    code, _, err = tic("cut", ex.name, "small2")
    assert code == 2 and "no *.safetensors" in err and "-c" in err
    assert tic("cut", "-c", str(ex / "tic.yaml"), ex.name, "small3")[0] == 0


def test_check_script_without_arguments_prints_usage():
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu" / "check.py")], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "usage" in r.stderr and "Traceback" not in r.stderr
