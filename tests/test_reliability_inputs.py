"""Issue 27: no output replaces an input, a record's hashes are of the bytes the gate measured, token ids are ids,
every count is bounded and every bad input (unreadable files, paths as the run resolves them, weight headers) is
refused with one line and exit 2 before anything under .tic/ is written; SIGTERM ends a run like SIGINT."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _one_line_exit_2(code, out, err, message=""):
    assert code == 2, (code, out, err)
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("tic: error:"), err
    assert message in lines[0], lines[0]


@pytest.fixture
def model(model_with_weights, workdir):
    d = workdir / "model"
    shutil.copytree(model_with_weights, d)
    return d


def _dump(path: Path, logprobs=(-0.5, -1.25, -2.0), **extra) -> Path:
    rec = {"prompt_ids": [5, 6, 7], "response_ids": [10, 11, 12], "logprobs": list(logprobs), **extra}
    path.write_text(json.dumps(rec) + "\n")
    return path


def _dump_config(workdir: Path, name: str = "tic.yaml") -> Path:
    _dump(workdir / "r.jsonl")
    _dump(workdir / "t.jsonl")
    cfg = workdir / name
    cfg.write_text("rollout: {engine: dump, dump: r.jsonl}\ntrain: {engine: dump, dump: t.jsonl}\n"
                   "locate: {enabled: false}\n")
    return cfg


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ---- outputs never replace inputs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["tic.yaml", "r.jsonl", "t.jsonl", ".tic/results/C5.json"])
@pytest.mark.parametrize("command", [["gate", "C5"], ["ladder", "--from", "C5", "--to", "C5"]])
def test_junit_never_replaces_an_input(tic, workdir, command, target):
    cfg = _dump_config(workdir)
    code, _, err = tic("gate", "C5", "-c", str(cfg))
    assert code == 0, err
    before = _files(workdir)
    _one_line_exit_2(*tic(*command, "-c", str(cfg), "--junit", str(workdir / target)), "--junit")
    assert _files(workdir) == before


def test_junit_through_a_symlink_or_hard_link_to_an_input(tic, workdir):
    cfg = _dump_config(workdir)
    (workdir / "via-symlink.xml").symlink_to(workdir / "r.jsonl")
    os.link(workdir / "t.jsonl", workdir / "via-hardlink.xml")
    before = _files(workdir)
    for name in ("via-symlink.xml", "via-hardlink.xml"):
        _one_line_exit_2(*tic("gate", "C5", "-c", str(cfg), "--junit", str(workdir / name)), "an input")
    assert _files(workdir) == before


@pytest.mark.parametrize("target", ["model/config.json", "model/model.safetensors", "model/extra.safetensors"])
def test_junit_never_writes_into_the_model(tic, workdir, model, target):
    cfg = workdir / "tic.yaml"
    cfg.write_text(f"model: {{path: {model}}}\n")
    before = _files(workdir)
    _one_line_exit_2(*tic("gate", "C0", "-c", str(cfg), "--junit", str(workdir / target)), "--junit")
    assert _files(workdir) == before


def test_junit_beside_the_model_files_is_allowed(tic, workdir, model):
    """The examples keep tic.yaml in the model folder: a report written there replaces no input."""
    cfg = model / "tic.yaml"
    cfg.write_text("model: {path: .}\n")
    code, _, err = tic("gate", "C0", "-c", str(cfg), "--junit", str(model / "report.xml"))
    assert code == 0, err
    assert (model / "report.xml").read_text().startswith("<?xml")


@pytest.mark.parametrize("out", ["model", "."])
def test_cut_out_naming_the_model_or_holding_it(tic, workdir, model, tree_hash, out):
    cfg = workdir / "tic.yaml"
    cfg.write_text(f"model: {{path: model}}\ncut: {{out: '{out}'}}\n")
    before = _files(workdir)
    _one_line_exit_2(*tic("gate", "C2", "-c", str(cfg)), "cut.out")
    assert _files(workdir) == before


def test_state_dir_whose_results_hold_an_input(tic, workdir):
    (workdir / "st" / "results").mkdir(parents=True)
    _dump(workdir / "st" / "results" / "C5.json")
    _dump(workdir / "t.jsonl")
    cfg = workdir / "tic.yaml"
    cfg.write_text("rollout: {engine: dump, dump: st/results/C5.json}\ntrain: {engine: dump, dump: t.jsonl}\n"
                   "state_dir: st\nlocate: {enabled: false}\n")
    before = _files(workdir)
    _one_line_exit_2(*tic("gate", "C5", "-c", str(cfg)), "the rollout dump")
    assert _files(workdir) == before


# ---- a record's hashes are of the bytes measured ------------------------------------------------------------------
def test_dump_edited_while_the_gate_reads_it_records_nothing(tic, workdir, monkeypatch):
    """An RL framework still writing its dump: the file changes while C5 measures. No pass may be recorded on
    hashes of the edited file (the old code hashed after measuring: exit 0, and `tic status` said not stale)."""
    from tic.gates import c5

    cfg = _dump_config(workdir)
    measure = c5.GATE.measure

    def measure_then_edit(ctx):
        m = measure(ctx)
        _dump(workdir / "t.jsonl", logprobs=(-0.5, -1.25, -2.5))  # the producer's next write
        return m

    monkeypatch.setattr(c5.GATE, "measure", measure_then_edit)
    _one_line_exit_2(*tic("gate", "C5", "-c", str(cfg)), "changed while the gate read it")
    assert not (workdir / ".tic" / "results" / "C5.json").exists()
    monkeypatch.setattr(c5.GATE, "measure", measure)
    code, _, err = tic("gate", "C5", "-c", str(cfg))
    assert code == 1, err  # the files as they are now differ: a fail, never the earlier pass


def test_model_edited_while_the_gate_reads_it_records_nothing(tic, workdir, model, monkeypatch):
    from tic.gates import c0

    cfg = workdir / "tic.yaml"
    cfg.write_text(f"model: {{path: {model}}}\n")
    measure = c0.GATE.measure

    def measure_then_edit(ctx):
        m = measure(ctx)
        shard = model / "model.safetensors"
        data = bytearray(shard.read_bytes())
        data[-1] ^= 1
        shard.write_bytes(bytes(data))
        return m

    monkeypatch.setattr(c0.GATE, "measure", measure_then_edit)
    _one_line_exit_2(*tic("gate", "C0", "-c", str(cfg)), "the model changed")
    assert not (workdir / ".tic" / "results" / "C0.json").exists()


# ---- ids are ids; numbers float64 cannot hold are refused ---------------------------------------------------------
@pytest.mark.parametrize("rollout, train, message", [
    ({"prompt_ids": [-1, 6]}, {"prompt_ids": [-1, 6]}, "prompt_ids must be a list of token ids"),
    ({"response_ids": [2**64, 11, 12]}, {"response_ids": [2**64, 11, 12]}, "response_ids must be"),
    ({"response_ids": [True, 11, 12]}, {"response_ids": [True, 11, 12]}, "response_ids must be"),
    ({"id": True}, {"id": 1}, "id must be a string or an integer"),
    ({"logprobs": [-(2**53 + 1), -1, -2]}, {"logprobs": [-(2**53), -1, -2]}, "float64 cannot hold exactly"),
    ({"weight_version": 2**64}, {"weight_version": 2**64}, "weight_version"),
])
def test_compare_refuses_what_is_not_an_id_or_not_exact(tic, workdir, tree_hash, rollout, train, message):
    base = {"prompt_ids": [5, 6], "response_ids": [10, 11, 12], "logprobs": [-0.5, -1.0, -2.0]}
    (workdir / "r.jsonl").write_text(json.dumps({**base, **rollout}) + "\n")
    (workdir / "t.jsonl").write_text(json.dumps({**base, **train}) + "\n")
    before = _files(workdir)
    _one_line_exit_2(*tic("compare", "r.jsonl", "t.jsonl"), message)
    assert _files(workdir) == before


def test_prompts_file_token_ids_are_ids(tic, workdir, model):
    (workdir / "p.jsonl").write_text("[5, true]\n")
    cfg = workdir / "tic.yaml"
    cfg.write_text(f"model: {{path: {model}}}\nprompts: {{source: file, file: p.jsonl}}\n")
    _one_line_exit_2(*tic("gate", "C3", "-c", str(cfg)), "expected a non-empty list of token ids")


# ---- every count bounded, before any work -------------------------------------------------------------------------
@pytest.mark.parametrize("body, message", [
    ("training: {updates: 100000000}\n", "training.updates"),
    ("perf: {output_len: 100000000}\n", "perf.output_len"),
    ("perf: {requests: 100000000}\n", "perf.requests"),
    ("scale_up: [{max_tokens: 100000000}]\n", "scale_up.0.max_tokens"),
    ("scale_up: [{prompt_len: 100000000}]\n", "scale_up.0.prompt_len"),
])
def test_counts_are_capped(tic, workdir, model, body, message):
    cfg = workdir / "tic.yaml"
    cfg.write_text(f"model: {{path: {model}}}\n" + body)
    _one_line_exit_2(*tic("ladder", "-c", str(cfg)), message)
    assert not (workdir / ".tic").exists()


def test_max_tokens_past_the_models_positions(tic, workdir, model):
    """max_position_embeddings of the tiny model is 512: a typo such as 100000 ran on (killed at 150 s)."""
    cfg = workdir / "tic.yaml"
    cfg.write_text(f"model: {{path: {model}}}\nsampling: {{max_tokens: 100000}}\n")
    _one_line_exit_2(*tic("gate", "C3", "-c", str(cfg)), "past the model's max_position_embeddings 512")
    assert not (workdir / ".tic").exists()


# ---- the model's files: checked before anything is written --------------------------------------------------------
def test_generated_model_too_large_for_memory(tic, workdir, monkeypatch):
    """config.json with only model_type: transformers' default sizes (billions of parameters) would be
    allocated. Measured on the meta device first; here the machine is made small rather than the model big."""
    d = workdir / "m"
    d.mkdir()
    cfg_json = json.loads((REPO / "examples" / "tiny-qwen3" / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg_json))
    real_sysconf = os.sysconf
    monkeypatch.setattr(os, "sysconf", lambda k: 1 if k == "SC_PHYS_PAGES" else real_sysconf(k))
    cfg = workdir / "tic.yaml"
    cfg.write_text("model: {path: m, generate: {seed: 0}}\n")
    _one_line_exit_2(*tic("gate", "C0", "-c", str(cfg)), "state the model's sizes")
    assert not (workdir / ".tic").exists()


def test_a_config_its_model_class_cannot_build_is_bad_input(tic, workdir):
    """Weights to generate from a config.json that transformers' config class accepts and its model class refuses
    (a padding id outside the vocabulary): one line, exit 2, never an internal error, and nothing under .tic/."""
    d = workdir / "m"
    d.mkdir()
    c = json.loads((REPO / "examples" / "tiny-qwen3" / "config.json").read_text())
    c["pad_token_id"] = c["vocab_size"] + 7
    (d / "config.json").write_text(json.dumps(c))
    cfg = workdir / "tic.yaml"
    cfg.write_text("model: {path: m, generate: {seed: 0}}\n")
    _one_line_exit_2(*tic("gate", "C0", "-c", str(cfg)), "transformers cannot build Qwen3Config")
    assert not (workdir / ".tic").exists()


def test_a_config_whose_checkpoint_transformers_cannot_write_is_bad_input(tic, workdir, monkeypatch):
    """save_pretrained reverts transformers' load-time weight conversions of the model type; where one cannot take
    the tensors a config builds (transformers 5.25's inkling2 pads the embedding to a smaller text vocabulary: a
    negative dimension), generating the weights failed as an internal error. It is found on the meta-device model
    before any weight is drawn: one line, exit 2, nothing under .tic/ and no generated weights. Planted here by a
    conversion that fails as that one does; the control is every other test that generates a model."""
    import transformers.core_model_loading as loading

    drawn = []
    monkeypatch.setattr(loading, "revert_weight_conversion", lambda model, state: (_ for _ in ()).throw(
        RuntimeError("Trying to create tensor with negative dimension -7: [-7, 64]")))
    monkeypatch.setattr("torch.manual_seed", lambda seed: drawn.append(seed))
    monkeypatch.setenv("TIC_CACHE", str(workdir / "cache"))  # weights other tests generated are not found here
    d = workdir / "m"
    d.mkdir()
    (d / "config.json").write_text((REPO / "examples" / "tiny-qwen3" / "config.json").read_text())
    cfg = workdir / "tic.yaml"
    cfg.write_text("model: {path: m, generate: {seed: 0}}\n")
    _one_line_exit_2(*tic("gate", "C0", "-c", str(cfg)), "transformers cannot write a checkpoint of the "
                     "Qwen3ForCausalLM it builds from it (its weight conversion fails: RuntimeError: Trying to create "
                     "tensor with negative dimension -7")
    assert not (workdir / ".tic").exists() and drawn == []


def test_the_checkpoint_check_reverts_real_conversions_on_the_meta_device():
    """The control on a model type whose checkpoint transformers converts (fused experts saved per expert): the
    check passes on the meta device, where no weight exists."""
    from transformers import CONFIG_MAPPING

    from tic.harness.model.generate import _check_checkpoint_writable
    from tic.harness.model.layer_structure import build_meta

    model = build_meta(CONFIG_MAPPING["qwen3_moe"](vocab_size=128, hidden_size=64, intermediate_size=128,
                                                   moe_intermediate_size=32, num_hidden_layers=2, num_experts=4,
                                                   num_experts_per_tok=2, num_attention_heads=4,
                                                   num_key_value_heads=2, head_dim=16).to_dict())
    assert next(model.parameters()).is_meta
    _check_checkpoint_writable(model, Path("m"))


def _rewrite_header(shard: Path, change) -> None:
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    change(header)
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    shard.write_bytes(struct.pack("<Q", len(hb)) + hb + data[8 + n:])


def _first_tensor(h):
    return h[next(k for k in h if k != "__metadata__")]


@pytest.mark.parametrize("change, message", [
    (lambda h: _first_tensor(h).update(shape=[3] + _first_tensor(h)["shape"]), "data_offsets span"),
    (lambda h: _first_tensor(h).update(dtype="Q7"), "unknown dtype 'Q7'"),
])
def test_weight_header_checked_before_any_record(tic, workdir, model, change, message):
    cfg = workdir / "tic.yaml"
    cfg.write_text(f"model: {{path: {model}}}\n")
    code, _, err = tic("gate", "C0", "-c", str(cfg))
    assert code == 0, err
    _rewrite_header(model / "model.safetensors", change)
    before = _files(workdir / ".tic")
    _one_line_exit_2(*tic("ladder", "--to", "C2", "-c", str(cfg)), message)
    assert _files(workdir / ".tic") == before


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(rope_theta=float("nan")), "not valid JSON"),
    (lambda c: c.update(hidden_act="swishy"), "hidden_act \"swishy\" is not an activation"),
    (lambda c: c.update(num_attention_heads=4, num_key_value_heads=8), "num_attention_heads 4 is not a multiple of "
                                                                        "num_key_value_heads 8"),
])
def test_model_config_refused_in_preflight(tic, workdir, model, change, message):
    """Refused before C0 writes its record (the old code found these only where a gate builds the model)."""
    c = json.loads((model / "config.json").read_text())
    change(c)
    (model / "config.json").write_text(json.dumps(c))
    cfg = workdir / "tic.yaml"
    cfg.write_text(f"model: {{path: {model}}}\n")
    _one_line_exit_2(*tic("ladder", "--to", "C3", "-c", str(cfg)), message)
    assert not (workdir / ".tic").exists()


@pytest.mark.parametrize("limit", ["[0.0, Infinity]", '[0.0, {"__float__": "Infinity"}]'])
def test_an_infinite_time_step_limit_as_transformers_writes_it_is_read(tic, workdir, example, one_thread, limit):
    """A Mamba-2 config's time_step_limit (0, inf): bare Infinity as transformers 4 saved it (checkpoints on the
    hub carry it), or transformers 5's tagged float. Both are read, and the model climbs C0-C4 as without it; the
    old reader refused the first as invalid JSON (exit 2). NaN stays refused (above)."""
    ex = example("tiny-mamba2")
    text = (ex / "config.json").read_text().rstrip().rstrip("}").rstrip()
    (ex / "config.json").write_text(f'{text},\n  "time_step_limit": {limit}\n}}\n')
    code, out, err = tic("ladder", "-c", str(ex / "tic-consistent.yaml"), "--from", "C0", "--to", "C4", "--json")
    verdicts = {r["gate"]: r["verdict"] for r in json.loads(out)["results"]}
    assert verdicts == {"C0": "pass", "C1": "waiting", "C2": "pass", "C3": "pass", "C4": "pass"}, (code, err)


# ---- the state directory as the run resolves it -------------------------------------------------------------------
def test_state_dir_is_checked_relative_to_tic_yaml(tic, workdir):
    """The run puts state_dir beside tic.yaml; the old check looked in the working directory (exit 3 later)."""
    sub = workdir / "sub"
    sub.mkdir()
    cfg = _dump_config(sub)
    (sub / "st").write_text("a file, not a folder")
    cfg.write_text(cfg.read_text() + "state_dir: st\n")
    _one_line_exit_2(*tic("gate", "C5", "-c", str(cfg)), "is not a directory")
    assert (sub / "st").read_text() == "a file, not a folder"


def test_dangling_state_symlink(tic, workdir):
    cfg = _dump_config(workdir)
    (workdir / ".tic").symlink_to(workdir / "nowhere")
    _one_line_exit_2(*tic("gate", "C5", "-c", str(cfg)), "symbolic link to nothing")
    assert not (workdir / "nowhere").exists()


def test_record_path_that_is_a_directory(tic, workdir):
    cfg = _dump_config(workdir)
    (workdir / ".tic" / "results" / "C5.json").mkdir(parents=True)
    _one_line_exit_2(*tic("gate", "C5", "-c", str(cfg)), "is not a regular file")


# ---- inputs that are no regular file or cannot be read ------------------------------------------------------------
def test_read_only_results_folder(tic, workdir, monkeypatch):
    """Found only after measuring before (exit 3). As root no mode bit refuses a write: os.access says no."""
    cfg = _dump_config(workdir)
    results = workdir / ".tic" / "results"
    results.mkdir(parents=True)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != results and real_access(p, mode))
    _one_line_exit_2(*tic("gate", "C5", "-c", str(cfg)), "is not writable")
    assert not any(results.iterdir())


@pytest.mark.parametrize("kind", ["dir", "fifo"])
def test_dump_that_is_not_a_regular_file(tic, workdir, kind):
    cfg = _dump_config(workdir)
    (workdir / "r.jsonl").unlink()
    if kind == "dir":
        (workdir / "r.jsonl").mkdir()
    else:
        os.mkfifo(workdir / "r.jsonl")
    _one_line_exit_2(*tic("gate", "C5", "-c", str(cfg)), "is a directory" if kind == "dir" else "not a regular file")


def test_unreadable_dump_is_an_input_error(tic, workdir, monkeypatch):
    """As root no permission bit stops a read, so the system's refusal is simulated where tic opens the file."""
    cfg = _dump_config(workdir)
    real_open = Path.open

    def refuse(self, *a, **k):
        if self.name == "r.jsonl":
            raise PermissionError(13, "Permission denied")
        return real_open(self, *a, **k)

    monkeypatch.setattr(Path, "open", refuse)
    _one_line_exit_2(*tic("gate", "C5", "-c", str(cfg)), "Permission denied")
    assert not (workdir / ".tic").exists()


def test_prompts_file_not_utf8(tic, workdir, model):
    (workdir / "p.jsonl").write_bytes(b"[5, 6]\n[\xff]\n")
    cfg = workdir / "tic.yaml"
    cfg.write_text(f"model: {{path: {model}}}\nprompts: {{source: file, file: p.jsonl}}\n")
    _one_line_exit_2(*tic("gate", "C3", "-c", str(cfg)), "not UTF-8")


# ---- SIGTERM like SIGINT: no partial cache entry ------------------------------------------------------------------
def test_sigterm_while_generating_leaves_no_partial_cache_entry(tmp_path):
    """The weights are being saved when SIGTERM arrives: exit as for Ctrl-C (2), the cache holds no partial
    model (the old code died on the signal, leaving its half-written temporary folder)."""
    cache = tmp_path / "cache"
    model = tmp_path / "m"
    model.mkdir()
    shutil.copy(REPO / "examples" / "tiny-qwen3" / "config.json", model / "config.json")
    (tmp_path / "tic.yaml").write_text("model: {path: m, generate: {seed: 0}}\n")
    script = textwrap.dedent("""
        import os, signal, time
        import transformers
        def save_then_signal(self, path, **kw):
            os.makedirs(path, exist_ok=True)
            open(os.path.join(path, "model.safetensors"), "wb").write(b"partial")
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
        transformers.PreTrainedModel.save_pretrained = save_then_signal
        from tic.skill.cli import main
        main(["gate", "C0", "-c", "tic.yaml"])
    """)
    env = {**os.environ, "TIC_CACHE": str(cache)}
    p = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert p.returncode != -signal.SIGTERM
    left = [str(x.relative_to(cache)) for x in cache.rglob("*") if x.is_file()] if cache.exists() else []
    assert left == []
    assert not (tmp_path / ".tic").exists()
