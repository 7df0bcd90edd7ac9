"""Issue 12: every bad input exits 2 with one line before any write (.tic/ byte for byte as it was), no input
is ever deleted, stale inputs are marked stale, and vacuous comparisons are refused."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from tic.harness.engines import hf

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def setup(model_with_weights, workdir, tic):
    """(model dir, write_config(text) -> path) in a workdir whose .tic/ already holds a C0 record."""
    model = workdir / "model"
    shutil.copytree(model_with_weights, model)

    def write_config(body: str, name: str = "tic.yaml") -> Path:
        p = workdir / name
        p.write_text(f"model: {{path: {model}}}\n" + body)
        return p

    code, _, err = tic("gate", "C0", "-c", str(write_config("")))
    assert code == 0, err
    return model, write_config


@pytest.fixture
def refused(tic, workdir, tree_hash):
    """refused(args, message): the command exits 2 with one line naming the problem, .tic/ unchanged."""
    return lambda args, message: _assert_input_error(tic, workdir, tree_hash, args, message)


def _assert_input_error(tic, workdir, tree_hash, args, message):
    before = tree_hash(workdir / ".tic")
    code, out, err = tic(*args)
    assert code == 2, (code, out, err)
    lines = [l for l in err.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("tic: error:"), err
    assert message in lines[0], lines[0]
    assert tree_hash(workdir / ".tic") == before


def records(n=3, ids=True):
    out = []
    for i in range(n):
        rec = {"prompt_ids": [5, 6, 7 + i], "response_ids": [10 + i, 11, 12], "logprobs": [-0.5, -1.25, -2.0 - i]}
        if ids:
            rec["id"] = f"s{i}"
        out.append(rec)
    return out


def write_dump(path: Path, recs) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


# ---- tic.yaml ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("body, message", [
    ("layouts: {batch_sizes: [0]}\n", "layouts.batch_sizes.0: Input should be greater than or equal to 2"),
    ("layouts: {batch_sizes: [1]}\n", "layouts.batch_sizes.0"),
    ("layouts: {batch_sizes: [-3]}\n", "layouts.batch_sizes.0"),
    ("layouts: {batch_sizes: []}\n", "layouts.batch_sizes: List should have at least 1 item"),
    ("layouts: {train: []}\n", "layouts.train: List should have at least 1 item"),
    ("rollout: {batch_size: true}\n", "rollout.batch_size: Input should be a valid integer (got true)"),
    ("rollout: {batch_size: 8}\nrollout: {batch_size: 4}\n", "duplicate key 'rollout'"),
    ("sampling: {max_tokens: 4, max_tokens: 5}\n", "duplicate key 'max_tokens'"),
    ("a: &a [1, 2]\nb: *a\n", "anchor &a is not allowed"),
    ("cut: {layers: 'a,b'}\n", "cut.layers"),
    ("sampling: {temperature: .nan}\n", "sampling.temperature"),
    ("prompts: {count: 100000000000000000000}\n", "prompts.count"),
])
def test_bad_tic_yaml_exits_2_before_any_write(refused, setup, workdir, tic, body, message):
    _, write_config = setup
    refused(["ladder", "-c", str(write_config(body))], message)


def test_every_validation_error_is_listed_with_allowed_values(setup, workdir, tic):
    _, write_config = setup
    cfg = write_config("rollout: {engine: sglang, batch_size: 0}\nsampling: {max_tokens: lots}\n")
    code, _, err = tic("gate", "C0", "-c", str(cfg))
    assert code == 2 and "more)" not in err
    for part in ("rollout.engine: Input should be 'hf', 'vllm', 'dump' or 'megatron' (got 'sglang')", "rollout.batch_size",
                 "sampling.max_tokens"):
        assert part in err


def test_alias_bomb_is_refused_fast(refused, setup, workdir, tic):
    _, write_config = setup
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
    refused(["ladder", "-c", str(write_config(bomb))], "not allowed")


def test_non_utf8_tic_yaml(refused, setup, workdir, tic):
    _, write_config = setup
    cfg = write_config("")
    cfg.write_bytes(cfg.read_bytes() + b"# caf\xe9\n")
    refused(["ladder", "-c", str(cfg)], "not UTF-8")


def test_state_dir_naming_a_file(refused, setup, workdir, tic):
    _, write_config = setup
    (workdir / "afile").write_text("x")
    refused(["gate", "C0", "-c", str(write_config("state_dir: afile\n"))],
                       "is not a directory")
    assert (workdir / "afile").read_text() == "x"


# ---- the model's config.json and weights --------------------------------------------------------------------------
@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(model_type="not_a_model"), "model_type 'not_a_model'"),
    (lambda c: c.update(vocab_size=-5), "vocab_size must be positive"),
    (lambda c: c.update(num_hidden_layers="4"), "num_hidden_layers must be an integer"),
])
def test_bad_model_config_exits_2(refused, setup, workdir, tic, change, message):
    model, write_config = setup
    cfg = json.loads((model / "config.json").read_text())
    change(cfg)
    (model / "config.json").write_text(json.dumps(cfg))
    refused(["ladder", "-c", str(write_config(""))], message)


def test_non_utf8_model_config(refused, setup, workdir, tic):
    model, write_config = setup
    p = model / "config.json"
    p.write_bytes(p.read_bytes().replace(b'"qwen3"', b'"qw\xffen3"'))
    refused(["gate", "C0", "-c", str(write_config(""))], "not UTF-8")


def _rewrite_header(shard: Path, header) -> None:
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    hb = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(hb)) + hb + data[8 + n:])


@pytest.mark.parametrize("make, message", [
    (lambda h: ["a", "list"], "header is a JSON list"),
    (lambda h: {k: ({kk: vv for kk, vv in v.items() if kk != "data_offsets"} if k != "__metadata__" else v)
                for k, v in h.items()}, "lacks data_offsets"),
])
def test_bad_safetensors_header_exits_2(refused, setup, workdir, tic, make, message):
    model, write_config = setup
    shard = next(model.glob("*.safetensors"))
    (n,) = struct.unpack("<Q", shard.read_bytes()[:8])
    header = json.loads(shard.read_bytes()[8:8 + n])
    _rewrite_header(shard, make(header))
    refused(["ladder", "-c", str(write_config(""))], message)


# ---- engines, prompts, cut settings: checked before C0 writes -------------------------------------------------------
@pytest.mark.parametrize("body, message", [
    ("prompts: {source: file, file: nowhere.jsonl}\n", "prompts file not found"),
    ("rollout: {engine: vllm}\n", "vllm"),
    ("train: {device: cuda}\n", "no CUDA GPU"),
    ("cut: {layers: [99]}\n", "out of range"),
    ("cut: {max_layers: 1}\n", "more than --max-layers 1"),
    ("train: {engine: vllm}\n", "vllm is a rollout engine"),
])
def test_late_checked_inputs_now_stop_before_c0(refused, setup, workdir, tic, body, message):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    _, write_config = setup
    refused(["ladder", "-c", str(write_config(body))], message)


def test_out_of_vocabulary_prompt(refused, setup, workdir, tic):
    _, write_config = setup
    (workdir / "p.jsonl").write_text("[5, 6, 7]\n[5, 600]\n")
    cfg = write_config(f"prompts: {{source: file, file: {workdir / 'p.jsonl'}}}\n")
    refused(["ladder", "-c", str(cfg)], "token id 600 outside the vocabulary")


def test_bad_cut_layers_read_even_while_a_cut_exists(refused, setup, workdir, tic):
    """A cut already in .tic/artifacts/C2/cut does not stop the settings from being checked."""
    from tic.harness.model.cut import cut_model

    model, write_config = setup
    cut_model(model, workdir / ".tic" / "artifacts" / "C2" / "cut", layers=[0, 1])
    refused(["gate", "C2", "-c", str(write_config("cut: {layers: [7]}\n"))],
                       "out of range")


def test_c6_layout_equal_to_the_reference_is_refused(refused, setup, workdir, tic):
    _, write_config = setup
    cfg = write_config("train: {micro_batch_size: 4}\nlayouts: {train: [{micro_batch_size: 4}]}\n")
    refused(["ladder", "-c", str(cfg)], "compare it with itself")


def test_empty_prompt_with_a_live_train_engine(refused, setup, workdir, tic):
    _, write_config = setup
    recs = records()
    recs[1]["prompt_ids"] = []
    write_dump(workdir / "r.jsonl", recs)
    cfg = write_config(f"rollout: {{engine: dump, dump: {workdir / 'r.jsonl'}}}\n")
    refused(["ladder", "--from", "C5", "--to", "C5", "-c", str(cfg)], "empty prompt_ids")
    refused(["gate", "C5", "-c", str(cfg)], "empty prompt_ids")


# ---- dumps and tic compare ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ids", [True, False])
def test_extra_train_record_is_an_error(refused, tmp_path, workdir, tic, ids):
    a = write_dump(tmp_path / "r.jsonl", records(3, ids))
    b = write_dump(tmp_path / "t.jsonl", records(4, ids))
    refused(["compare", str(a), str(b)], "more records than the rollout")
    c = write_dump(tmp_path / "t2.jsonl", list(reversed(records(4, ids))))
    if ids:  # another order, via the id index
        refused(["compare", str(a), str(c)], "no rollout counterpart")


def test_missing_train_record_is_an_error(refused, tmp_path, workdir, tic):
    a = write_dump(tmp_path / "r.jsonl", records(3))
    b = write_dump(tmp_path / "t.jsonl", records(2))
    refused(["compare", str(a), str(b)], "fewer records")


def test_positive_logprobs_are_an_input_error(refused, tmp_path, workdir, tic):
    recs = records()
    recs[0]["logprobs"][1] = 0.5
    a = write_dump(tmp_path / "r.jsonl", recs)
    b = write_dump(tmp_path / "t.jsonl", recs)
    refused(["compare", str(a), str(b)], "above 0")


def test_huge_integer_logprob(refused, tmp_path, workdir, tic):
    a = write_dump(tmp_path / "r.jsonl", records())
    b = tmp_path / "t.jsonl"
    b.write_text(a.read_text().replace("-0.5", "-" + "9" * 400, 1))
    refused(["compare", str(a), str(b)], "too large")


def test_a_dump_compared_with_itself_is_refused(refused, tmp_path, workdir, tic):
    a = write_dump(tmp_path / "r.jsonl", records())
    refused(["compare", str(a), str(a)], "compared with itself")


def test_mixed_ids_are_an_error(refused, tmp_path, workdir, tic):
    recs = records()
    del recs[2]["id"]
    a = write_dump(tmp_path / "r.jsonl", records())
    b = write_dump(tmp_path / "t.jsonl", recs)
    refused(["compare", str(a), str(b)], "no id")


# ---- never delete what tic did not make ----------------------------------------------------------------------------
def test_cut_never_deletes_an_input_inside_out_dir(tree_hash, model_with_weights, tmp_path, workdir, tic):
    a = tmp_path / "A"
    shutil.copytree(model_with_weights, a / "inner")
    (a / "cut.json").write_text(json.dumps({"source": "x", "layers": [0]}))
    before = tree_hash(a)
    code, _, err = tic("cut", str(a / "inner"), str(a))
    assert code == 2 and "contains the model directory" in err
    assert tree_hash(a) == before
    code, _, err = tic("cut", str(a / "inner"), str(a / "inner" / "sub"))
    assert code == 2 and "inside the model directory" in err
    assert tree_hash(a) == before


def test_cut_refuses_a_file_and_a_foreign_directory(model_with_weights, tmp_path, tic):
    (tmp_path / "f").write_text("keep")
    code, _, err = tic("cut", str(model_with_weights), str(tmp_path / "f"))
    assert code == 2 and "not a directory" in err and (tmp_path / "f").read_text() == "keep"
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("keep")
    code, _, err = tic("cut", str(model_with_weights), str(tmp_path / "d"))
    assert code == 2 and "no earlier tic cut" in err and (tmp_path / "d" / "notes.txt").read_text() == "keep"


def test_cut_without_weights_says_so(tmp_path, tic):
    d = tmp_path / "m"
    shutil.copytree(REPO / "examples" / "tiny-qwen3", d)
    code, _, err = tic("cut", str(d), str(tmp_path / "out"))
    assert code == 2 and "no weights found" in err


# ---- staleness ------------------------------------------------------------------------------------------------------
def _ctx(cfg_path):
    from tic.config.schema import load_config
    from tic.skill.context import GateContext

    return GateContext(load_config(cfg_path))


def test_stale_cut_is_rebuilt(setup, workdir):
    """The C2 cut is reused only for the same model content and the same cut settings."""
    from tic.gates.c2 import cut_request
    from tic.harness.model.cut_check import cut_dir_for, must_build

    def cut(cfg_path, build=False):
        ctx = _ctx(cfg_path)
        req = cut_request(ctx.cfg, ctx.state)
        return (cut_dir_for if build else must_build)(req, ctx.model.dir, ctx.model_hash)

    model, write_config = setup
    cfg = write_config("cut: {layers: [0, 1]}\n")
    out = cut(cfg, build=True)
    assert json.loads((out / "cut.json").read_text())["layers"] == [0, 1]
    assert cut(cfg) is False
    cfg = write_config("cut: {layers: [1, 2]}\n")
    assert cut(cfg) is True
    assert cut(cfg, build=True) == out
    assert json.loads((out / "cut.json").read_text())["layers"] == [1, 2]
    assert cut(cfg) is False
    shard = next(model.glob("*.safetensors"))  # change the last bytes (lm_head's data lies somewhere in there)
    data = bytearray(shard.read_bytes())
    data[-4:] = bytes(4)
    shard.write_bytes(bytes(data))
    assert cut(cfg) is True


def test_status_reads_only_its_own_record_names_and_shows_unreadable(setup, workdir, tic):
    _, write_config = setup
    cfg = write_config("")
    res = workdir / ".tic" / "results"
    c0 = json.loads((res / "C0.json").read_text())
    (res / "C5.json").write_text(json.dumps({**c0, "gate": "C5", "verdict": "fail"}))
    (res / "C5.old.json").write_text(json.dumps({**c0, "gate": "C5", "verdict": "pass"}))
    (res / "C3.json").write_text(json.dumps({**c0, "gate": "C3", "started_at": "yesterday"}))
    code, out, err = tic("status", "-c", str(cfg), "--json")
    assert code == 0, err
    gates = {g["gate"]: g for g in json.loads(out)["gates"]}
    assert gates["C5"]["verdict"] == "fail" and gates["C3"]["verdict"] == "unreadable"
    assert gates["C0"]["verdict"] == "pass"


def test_status_sees_a_changed_cut_from_any_working_directory(setup, workdir, tic, tmp_path, monkeypatch):
    """tic's own cut lies in the state directory beside tic.yaml, wherever `tic status` runs from: unchanged it is
    current, changed it is stale (the hash used to look for it relative to the working directory)."""
    _, write_config = setup
    cfg = write_config("cut: {layers: [0, 1]}\n")
    assert tic("gate", "C2", "-c", str(cfg))[0] == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)

    def stale():
        out = tic("status", "-c", str(cfg), "--json")[1]
        return {g["gate"]: g for g in json.loads(out)["gates"]}["C2"]["stale"]

    assert stale() == "no"
    cut_config = workdir / ".tic" / "artifacts" / "C2" / "cut" / "config.json"
    cut_config.write_text(cut_config.read_text() + "\n")
    assert "inputs changed (cut)" in stale()


def test_status_marks_changed_dumps_and_prompts_stale(setup, workdir, tic):
    _, write_config = setup
    r = write_dump(workdir / "r.jsonl", records())
    t = write_dump(workdir / "t.jsonl", records())
    cfg = write_config(f"rollout: {{engine: dump, dump: {r}}}\ntrain: {{engine: dump, dump: {t}}}\n")
    assert tic("gate", "C5", "-c", str(cfg))[0] == 0

    def stale():
        out = tic("status", "-c", str(cfg), "--json")[1]
        return {g["gate"]: g for g in json.loads(out)["gates"]}["C5"]["stale"]

    assert stale() == "no"
    recs = records()
    recs[0]["logprobs"][0] = -0.75  # same size, same mtime kept: only the content says so
    st = t.stat()
    write_dump(t, recs)
    os.utime(t, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert "inputs changed (train dump)" in stale()
    (workdir / "p.jsonl").write_text("[5, 6, 7]\n")
    cfg = write_config(f"prompts: {{source: file, file: {workdir / 'p.jsonl'}}}\n", "p.yaml")
    assert tic("gate", "C0", "-c", str(cfg))[0] == 0  # C0 does not read prompts: never stale for them
    from tic.skill.fingerprint import input_hashes
    from tic.config.schema import load_config

    before = input_hashes(load_config(cfg), ("prompts",))
    (workdir / "p.jsonl").write_text("[5, 6, 8]\n")
    assert input_hashes(load_config(cfg), ("prompts",)) != before


def test_large_shard_edit_with_mtime_restored_is_detected(tmp_path):
    """A >= 1 GiB shard (sparse here) changed in a byte no sampled block covers, its mtime set back."""
    from tic.harness.model.generate import model_hash

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    shard = d / "model.safetensors"
    with shard.open("wb") as f:
        f.truncate((1 << 30) + 12345)
    h0 = model_hash(d)
    st = shard.stat()
    with shard.open("r+b") as f:
        f.seek((1 << 29) + 777_777)  # between sampled blocks
        f.write(b"\x01")
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert shard.stat().st_mtime_ns == st.st_mtime_ns and shard.stat().st_size == st.st_size
    assert model_hash(d) != h0


def test_identical_pass_still_passes(setup, workdir, tic):
    """Control: the same valid dumps pass, so the checks above refuse bad input, not everything."""
    a = write_dump(workdir / "r.jsonl", records())
    b = write_dump(workdir / "t.jsonl", list(reversed(records())))
    assert tic("compare", str(a), str(b))[0] == 0
    hf._MODELS.clear()


def test_c2_check_fails_a_cut_of_another_model_version(setup, tmp_path):
    """A cut whose source changed afterwards (lm_head here) no longer matches its source byte for byte."""
    from safetensors.torch import load_file, save_file

    from tic.harness.model.cut import cut_model
    from tic.harness.model.cut_check import check_cut

    model, _ = setup
    cut = tmp_path / "cut"
    cut_model(model, cut, layers=[0, 1])
    assert check_cut(model, cut)["problems"] == []
    shard = next(model.glob("*.safetensors"))
    sd = load_file(shard)
    sd["lm_head.weight"][0, 0] += 1.0
    save_file(sd, shard, metadata={"format": "pt"})
    problems = check_cut(model, cut)["problems"]
    assert any("lm_head.weight: bytes differ" in p for p in problems), problems
