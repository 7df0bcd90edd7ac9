"""`tic compare` and the dump engine: exact verdicts, clear bad-input errors (exit 2), untouched state."""

import json

import numpy as np
import pytest


def write(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def records():
    g = np.random.default_rng(0)
    out = []
    for i in range(3):
        n = 5 + i
        lp = (-g.random(n) * 6).astype(np.float32)
        out.append({"id": f"s{i}", "prompt_ids": [3, 4, 5 + i], "response_ids": list(range(10, 10 + n)),
                    "logprobs": [float(x) for x in lp], "weight_version": 7})
    return out


def one_ulp(records, seq=1, pos=3):
    out = json.loads(json.dumps(records))
    x = np.float32(out[seq]["logprobs"][pos])
    out[seq]["logprobs"][pos] = float(np.nextafter(x, np.float32(0)))
    return out


def test_identical_dumps_pass(tmp_path, tic):
    a = write(tmp_path / "r.jsonl", records())
    b = write(tmp_path / "t.jsonl", records())
    code, out, _ = tic("compare", str(a), str(b), "--json")
    rec = json.loads(out)
    assert code == 0 and rec["verdict"] == "pass"
    assert rec["metrics"]["max"] == 0 and rec["metrics"]["k3_kl"] == 0 and rec["metrics"]["equal_fraction"] == 1


def test_one_ulp_fails_and_names_the_token(tmp_path, tic):
    a = write(tmp_path / "r.jsonl", records())
    b = write(tmp_path / "t.jsonl", one_ulp(records()))
    code, out, _ = tic("compare", str(a), str(b), "--json")
    rec = json.loads(out)
    assert code == 1 and rec["verdict"] == "fail"
    fm = rec["metrics"]["first_mismatch"]
    assert (fm["sequence"], fm["position"], fm["ulps"]) == (1, 3, 1)
    assert "sequence 1, position 3" in rec["reason"]
    # independent computation of the figures
    r = np.array(records()[1]["logprobs"], dtype=np.float64)
    t = np.array(one_ulp(records())[1]["logprobs"], dtype=np.float64)
    assert rec["metrics"]["max"] == pytest.approx(float(np.abs(np.exp(r) - np.exp(t)).max()), rel=1e-12)
    assert rec["metrics"]["equal_tokens"] == rec["metrics"]["tokens"] - 1


def test_matching_by_id_ignores_line_order(tmp_path, tic):
    a = write(tmp_path / "r.jsonl", records())
    b = write(tmp_path / "t.jsonl", list(reversed(records())))
    assert tic("compare", str(a), str(b))[0] == 0


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r[0].update(logprobs=r[0]["logprobs"][:-1]), "length mismatch"),
    (lambda r: r[0].pop("response_ids"), "missing field 'response_ids'"),
    (lambda r: r[0].update(extra=1), "unknown field 'extra'"),
    (lambda r: r[0].update(weight_version=8), "weight_version"),
    (lambda r: r[0].update(response_ids=[99] * len(r[0]["response_ids"])), "token ids differ"),
    (lambda r: r[0].update(mask=[1, 0]), "mask"),
])
def test_bad_train_dump_exits_2(tmp_path, tic, mutate, message):
    a = write(tmp_path / "r.jsonl", records())
    bad = records()
    mutate(bad)
    b = write(tmp_path / "t.jsonl", bad)
    code, out, err = tic("compare", str(a), str(b))
    assert code == 2, err
    assert message in err and len(err.strip().splitlines()) == 1


def test_nan_and_garbage_exit_2(tmp_path, tic):
    a = write(tmp_path / "r.jsonl", records())
    b = tmp_path / "t.jsonl"
    b.write_text(write(tmp_path / "x", records()).read_text().replace(str(records()[0]["logprobs"][0]), "NaN", 1))
    code, _, err = tic("compare", str(a), str(b))
    assert code == 2 and "NaN" in err
    b.write_text("{not json\n")
    code, _, err = tic("compare", str(a), str(b))
    assert code == 2 and "t.jsonl:1" in err
    code, _, err = tic("compare", str(a), str(tmp_path / "missing.jsonl"))
    assert code == 2 and "not found" in err


def test_dump_engines_in_a_ladder_and_state_untouched_on_bad_input(tmp_path, workdir, tic, example):
    ex = example("tiny-qwen3")
    write(tmp_path / "r.jsonl", records())
    write(tmp_path / "t.jsonl", one_ulp(records()))
    cfg = tmp_path / "dump.yaml"
    cfg.write_text(f"model: {{path: {ex}, generate: {{seed: 0}}}}\n"
                   f"rollout: {{engine: dump, dump: {tmp_path / 'r.jsonl'}}}\n"
                   f"train: {{engine: dump, dump: {tmp_path / 't.jsonl'}}}\n")
    code, out, err = tic("gate", "C5", "-c", str(cfg), "--json")
    assert code == 1 and json.loads(out)["results"][0]["metrics"]["first_mismatch"]["position"] == 3
    saved = {p: p.read_bytes() for p in (workdir / ".tic").rglob("*") if p.is_file()}
    assert saved
    (tmp_path / "t.jsonl").write_text('{"prompt_ids": [1], "response_ids": [2], "logprobs": []}\n')
    code, _, err = tic("gate", "C5", "-c", str(cfg))
    assert code == 2 and "length mismatch" in err
    after = {p: p.read_bytes() for p in (workdir / ".tic").rglob("*") if p.is_file()}
    assert after == saved


def test_dump_only_config_needs_no_model(tmp_path, workdir, tic):
    write(tmp_path / "r.jsonl", records())
    write(tmp_path / "t.jsonl", records())
    cfg = tmp_path / "dumps.yaml"
    cfg.write_text(f"rollout: {{engine: dump, dump: {tmp_path / 'r.jsonl'}}}\n"
                   f"train: {{engine: dump, dump: {tmp_path / 't.jsonl'}}}\n")
    code, out, err = tic("gate", "C5", "-c", str(cfg), "--json")
    assert code == 0, err
    assert tic("gate", "C0", "-c", str(cfg))[0] == 2  # C0 does need the model


def test_train_mask_is_used_and_must_agree(tmp_path, tic):
    a = write(tmp_path / "r.jsonl", records())
    t = one_ulp(records(), seq=0, pos=1)
    t[0]["mask"] = [1, 0] + [1] * (len(t[0]["response_ids"]) - 2)  # the changed token is masked out
    b = write(tmp_path / "t.jsonl", t)
    assert tic("compare", str(a), str(b))[0] == 0
    r = records()
    r[0]["mask"] = [1] * len(r[0]["response_ids"])
    a = write(tmp_path / "r2.jsonl", r)
    code, _, err = tic("compare", str(a), str(b))
    assert code == 2 and "mask differs" in err
