"""Config validation, exit codes, status/staleness, explain, JSON/NO_COLOR behaviour."""

import json
import os
import sys

import pytest

from tic.harness.engines import hf


@pytest.mark.parametrize("text, message", [
    ("model: {path: ., colour: red}\n", "model.colour: unknown key"),
    ("model: {path: .}\nsampling: {max_tokens: lots}\n", "sampling.max_tokens"),
    ("model: {path: .}\nrollout: {engine: sglang}\n", "rollout.engine"),
    ("model: {path: .}\nprompts: {min_len: 9, max_len: 3}\n", "min_len 9 > max_len 3"),
    ("model: {path: .}\ntrain: {order: sorted}\n", "train.order"),
    ("model: {path: .}\nlayouts: {train: [{order: upside}]}\n", "layouts.train.0.order"),
    ("- just\n- a list\n", "expected a mapping"),
    ("model: {path: .\n", "not valid YAML"),
    ("rollout: {engine: hf}\n", "this gate needs a model"),
    ("model: {path: ./nowhere}\n", "model directory not found"),
    ("model: {path: .}\n", "no *.safetensors"),
])
def test_bad_config_exits_2_with_the_path(example, workdir, tic, text, message):
    ex = example("tiny-qwen3")
    cfg = ex / "bad.yaml"
    cfg.write_text(text)
    code, out, err = tic("gate", "C0", "-c", str(cfg))
    assert code == 2, err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (workdir / ".tic").exists() and not (ex / ".tic").exists()


def test_usage_errors_exit_2(example, workdir, tic):
    ex = example("tiny-qwen3")
    assert tic("gate", "C42", "-c", str(ex / "tic.yaml"))[0] == 2
    assert tic("ladder", "-c", str(ex / "tic.yaml"), "--from", "C5", "--to", "C3")[0] == 2
    assert tic("gate", "C0", "-c", str(workdir / "missing.yaml"))[0] == 2
    assert tic("frobnicate")[0] == 2
    assert not (workdir / ".tic").exists() and not (ex / ".tic").exists()


def test_help_documents_exit_codes(tic):
    code, out, _ = tic("--help")
    assert code == 0 and "Exit codes" in out and "internal error" in out


def test_explain_shows_condition_as_code(tic):
    code, _, err = tic("explain", "C5")
    assert code == 0 and "def judge" in err and "diff = 0" in err and "C5.md" in err


def test_status_marks_stale_after_config_change(example, workdir, tic):
    hf._MODELS.clear()
    ex = example("tiny-qwen3")
    assert tic("gate", "C0", "-c", str(ex / "tic.yaml"))[0] == 0
    code, out, err = tic("status", "-c", str(ex / "tic.yaml"), "--json")
    gates = {g["gate"]: g for g in json.loads(out)["gates"]}
    assert gates["C0"]["verdict"] == "pass" and gates["C0"]["stale"] == "no"
    assert gates["C3"]["verdict"] == "not run"
    changed = ex / "tic.yaml"
    changed.write_text(changed.read_text().replace("max_tokens: 16", "max_tokens: 12"))
    out = tic("status", "-c", str(changed), "--json")[1]
    assert {g["gate"]: g for g in json.loads(out)["gates"]}["C0"]["stale"] == "config changed"


def test_no_color(example, workdir, tic, monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    code, _, err = tic("explain", "C0")
    assert code == 0 and "\x1b[" not in err


def test_json_record_has_fingerprint(example, workdir, tic):
    ex = example("tiny-qwen3")
    out = tic("gate", "C0", "-c", str(ex / "tic.yaml"), "--json")[1]
    r = json.loads(out)["results"][0]
    assert r["config_hash"] and r["model_hash"] and "torch" in r["environment"]["packages"]
    assert "env" in r["environment"] and r["environment"]["device"]


def test_json_stdout_carries_the_record_alone(example, workdir, capfd, monkeypatch):
    """Engines log to file descriptor 1 (vLLM's logger, processes they start, C code): with --json, all of it
    goes to stderr while the gate runs, and stdout holds exactly one JSON document."""
    import json
    import subprocess

    from tic.skill import cli, runner

    real = runner.run_gate

    def noisy(*a, **kw):
        print("noise from python")
        os.write(1, b"noise on fd 1\n")
        subprocess.run([sys.executable, "-c", "print('noise from a child process')"], check=True)
        return real(*a, **kw)

    monkeypatch.setattr(runner, "run_gate", noisy)
    monkeypatch.setattr(cli, "run_gate", noisy, raising=False)
    ex = example("tiny-qwen3")
    with pytest.raises(SystemExit):
        cli.main(["gate", "C0", "-c", str(ex / "tic.yaml"), "--json"])
    out, err = capfd.readouterr()
    assert json.loads(out)["results"][0]["gate"] == "C0"
    assert all(n in err for n in ("noise from python", "noise on fd 1", "noise from a child process"))
    print("after")  # fd 1 is stdout again once the run is over
    assert capfd.readouterr().out == "after\n"


def test_json_stdout_gets_no_text_buffered_during_the_run():
    """Text a library wrote during the run through a stdout object it held from before (a log handler made
    earlier, sys.__stdout__) sits in that object's buffer: it must go to stderr with the run's other output, not
    reach stdout ahead of the record once file descriptor 1 is stdout again."""
    import subprocess

    code = ("import sys\n"
            "from tic.skill.cli import _stdout_reserved\n"
            "held = sys.stdout\n"
            "with _stdout_reserved(True):\n"
            "    held.write('buffered noise\\n')\n"
            "    sys.__stdout__.write('more buffered noise\\n')\n"
            "print('{}')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout buffered, as users run it
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert r.stdout == "{}\n"
    assert "buffered noise" in r.stderr and "more buffered noise" in r.stderr


def test_every_command_takes_json_and_has_help():
    """README: all commands take --json; `tic --help` shows each command's first sentence whole."""
    import click

    from tic.skill.cli import cli

    def leaves(cmd, path):
        if isinstance(cmd, click.Group):
            for name, sub in cmd.commands.items():
                yield from leaves(sub, [*path, name])
        else:
            yield " ".join(path), cmd

    found = dict(leaves(cli, []))
    assert {"gate", "ladder", "explain", "patch show", "baseline run", "baseline approve",
            "skill install"} <= set(found)
    for name, cmd in found.items():
        assert "--json" in {o for p in cmd.params for o in p.opts}, f"tic {name} lacks --json"
        assert cmd.help, f"tic {name} has no help"
        assert all(p.help for p in cmd.params if isinstance(p, click.Option)), f"tic {name}: an option lacks help"


def test_explain_json(tic):
    code, out, _ = tic("explain", "C5", "--json")
    rec = json.loads(out)
    assert code == 0 and rec["gate"] == "C5" and "def judge" in rec["pass_condition_code"]


def test_status_writes_nothing_not_even_generated_weights(example, workdir, tic, tree_hash, tmp_path, monkeypatch):
    """`tic status` reads only: on a model whose weights are not generated yet it generates none (no model
    hash then), and once they exist it hashes them."""
    cache = tmp_path / "empty-cache"
    monkeypatch.setenv("TIC_CACHE", str(cache))
    hf._MODELS.clear()
    ex = example("tiny-qwen3")
    before = tree_hash(ex)
    code, out, _ = tic("status", "-c", str(ex / "tic.yaml"), "--json")
    assert code == 0 and json.loads(out)["model_hash"] is None
    assert tree_hash(ex) == before and not cache.exists()
    assert tic("gate", "C0", "-c", str(ex / "tic.yaml"))[0] == 0
    code, out, _ = tic("status", "-c", str(ex / "tic.yaml"), "--json")
    assert code == 0 and json.loads(out)["model_hash"]


def test_progress_only_on_a_terminal_and_never_with_json():
    import io

    from rich.console import Console
    from rich.status import Status

    from tic.skill import report

    tty = Console(file=io.StringIO(), force_terminal=True)
    assert isinstance(report.progress("running C3 ...", False, tty), Status)
    assert not isinstance(report.progress("running C3 ...", True, tty), Status)
    assert not isinstance(report.progress("running C3 ...", False, Console(file=io.StringIO())), Status)
    with report.progress("x", True, tty) as p:
        p.update("y")  # the same calls work when it is off
