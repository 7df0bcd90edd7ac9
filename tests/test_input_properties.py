"""Property tests (Hypothesis): random mutations of a valid tic.yaml, a valid model config.json and valid dumps
never end in an internal error (exit 3), and a bad input (exit 2) leaves the working directory, .tic/
included, byte for byte as it was. Validation is exercised the way a run starts (config load + the preflight of
the whole ladder), C0 and `tic compare` run whole: cheap paths, so well over 1,000 mutations stay fast."""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tic.core.errors import TicInputError

REPO = Path(__file__).resolve().parent.parent
def fast(n: int):
    """n examples, reproducible in CI (derandomized, no example database), no per-example deadline.
    For a soak run: TIC_PROPERTY_SCALE=20 TIC_PROPERTY_RANDOM=1 (more examples, fresh seeds)."""
    return settings(max_examples=n * int(os.environ.get("TIC_PROPERTY_SCALE", "1")), deadline=None,
                    derandomize=not os.environ.get("TIC_PROPERTY_RANDOM"), database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

VALUES = [0, 1, 2, -1, -3, 7, 10**400, 2**70, 1.5, -0.0, float("nan"), float("inf"), True, False, None, "",
          "a,b", "auto", "8", "cuda", "cpu", "vllm", "dump", "hf", "file", "random", "nowhere.jsonl", "left",
          "consistent", "0,1", [], [0], [1, 2], [-3], [True], [0, 1], ["first"], {}, {"x": 1},
          {"micro_batch_size": 1}, "model", "config.json"]
value = st.sampled_from(VALUES).map(copy.deepcopy)  # a fresh copy: mutations never reach the pool


@pytest.fixture(scope="module")
def space(tmp_path_factory, model_with_weights):
    """A working directory with the model (weights inside) and a valid tic.yaml dict."""
    d = tmp_path_factory.mktemp("prop")
    shutil.copytree(model_with_weights, d / "model")
    (d / "prompts.jsonl").write_text("[5, 6, 7]\n[8, 9]\n")
    base = {
        "model": {"path": "model", "dtype": "float32"},
        "rollout": {"engine": "hf", "kernels": "stock", "batch_size": 8},
        "train": {"engine": "hf", "micro_batch_size": 4, "padding_side": "right"},
        "prompts": {"source": "random", "count": 4, "seed": 0, "min_len": 4, "max_len": 8},
        "sampling": {"temperature": 1.0, "max_tokens": 4, "seed": 0},
        "layouts": {"batch_sizes": [2, 3], "positions": ["first", "last"], "probes": 1,
                    "train": [{"micro_batch_size": 1}]},
        "cut": {"layers": "auto", "max_layers": 4},
        "training": {"updates_per_step": 1},
    }
    return d, base


def _paths(obj, prefix=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))


EXTRA_PATHS = [("rollout", "device"), ("train", "device"), ("rollout", "dump"), ("train", "engine"),
               ("prompts", "file"), ("cut", "out"), ("state_dir",), ("model", "generate"), ("rollout", "options"),
               ("train", "kernels"), ("locate", "enabled"), ("rollout", "tensor_parallel_size"), ("colour",)]


def _set(d, path, v):
    for k in path[:-1]:
        if not isinstance(d.get(k), dict):
            d[k] = {}
        d = d[k]
    d[path[-1]] = v


def _delete(d, path):
    for k in path[:-1]:
        d = d.get(k) if isinstance(d, dict) else None
        if not isinstance(d, dict):
            return
    d.pop(path[-1], None)


@st.composite
def config_text(draw, base):
    cfg = json.loads(json.dumps(base))
    paths = sorted(set(_paths(base)) | set(EXTRA_PATHS))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths))
        if draw(st.booleans()):
            _set(cfg, path, draw(value))
        else:
            _delete(cfg, path)
    text = yaml.safe_dump(cfg, sort_keys=False).encode()
    return _mutate_bytes(draw, text)


def _mutate_bytes(draw, text: bytes) -> bytes:
    op = draw(st.sampled_from(["none", "none", "dup_line", "byte", "truncate", "alias"]))
    lines = text.splitlines(keepends=True)
    if op == "dup_line" and lines:
        i = draw(st.integers(0, len(lines) - 1))
        lines.insert(i, lines[i])
        return b"".join(lines)
    if op == "byte" and text:
        i = draw(st.integers(0, len(text) - 1))
        return text[:i] + bytes([draw(st.integers(0, 255))]) + text[i + 1:]
    if op == "truncate":
        return text[:draw(st.integers(0, len(text)))]
    if op == "alias":
        return b"x: &x [1, 2]\ny: *x\n" + text
    return text


def _validate(cfg_path: Path) -> int:
    """What `tic ladder` does before its first write: load tic.yaml, check every input of C0..C10."""
    from tic.gates import gate_range
    from tic.config.schema import load_config
    from tic.skill.context import GateContext
    from tic.skill.preflight import validate_run

    try:
        validate_run(GateContext(load_config(cfg_path)), gate_range())
    except TicInputError as e:
        assert str(e).strip()
        return 2
    return 0


@fast(500)
@given(data=st.data())
def test_mutated_configs_exit_0_or_2_and_write_nothing(space, monkeypatch, tree_hash, data):
    d, base = space
    monkeypatch.chdir(d)
    cfg_path = d / "tic.yaml"
    cfg_path.write_bytes(data.draw(config_text(base)))
    before = tree_hash(d)
    assert _validate(cfg_path) in (0, 2)
    assert tree_hash(d) == before


@fast(200)
@given(data=st.data())
def test_mutated_model_configs_never_exit_3(space, monkeypatch, tic, tree_hash, data):
    """C0 run whole on a mutated config.json: pass, fail or a clear input error with .tic/ untouched."""
    d, base = space
    monkeypatch.chdir(d)
    model_cfg = json.loads((REPO / "examples" / "tiny-qwen3" / "config.json").read_text())
    keys = sorted(model_cfg) + ["num_experts", "layer_types", "text_config", "auto_map"]
    for _ in range(data.draw(st.integers(1, 2))):
        k = data.draw(st.sampled_from(keys))
        if data.draw(st.booleans()):
            model_cfg[k] = data.draw(value)
        else:
            model_cfg.pop(k, None)
    original = (d / "model" / "config.json").read_bytes()
    (d / "model" / "config.json").write_bytes(_mutate_bytes(data.draw, json.dumps(model_cfg).encode()))
    (d / "c0.yaml").write_text("model: {path: model}\nstate_dir: state\n")
    try:
        before = tree_hash(d / "state")
        code, _, err = tic("gate", "C0", "-c", str(d / "c0.yaml"))
        assert code in (0, 1, 2), err
        if code == 2:
            assert tree_hash(d / "state") == before
    finally:
        (d / "model" / "config.json").write_bytes(original)


def records(n=3):
    return [{"id": f"s{i}", "prompt_ids": [5, 6, 7 + i], "response_ids": [10 + i, 11, 12],
             "logprobs": [-0.5, -1.25, -2.0 - i]} for i in range(n)]


@st.composite
def dump_pair(draw):
    rollout, train = records(), records()
    side = draw(st.sampled_from([rollout, train]))
    fields = ["prompt_ids", "response_ids", "logprobs", "mask", "weight_version", "id", "extra"]
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["set", "set", "delete", "dup", "drop", "swap", "set_item"]))
        i = draw(st.integers(0, len(side) - 1)) if side else 0
        if not side:
            break
        if op == "set":
            side[i][draw(st.sampled_from(fields))] = draw(value)
        elif op == "set_item":
            lst = side[i].get(draw(st.sampled_from(["prompt_ids", "response_ids", "logprobs"])))
            if isinstance(lst, list) and lst:
                lst[draw(st.integers(0, len(lst) - 1))] = draw(value)
        elif op == "delete":
            side[i].pop(draw(st.sampled_from(fields)), None)
        elif op == "dup":
            side.insert(i, json.loads(json.dumps(side[i])))
        elif op == "drop":
            side.pop(i)
        else:
            j = draw(st.integers(0, len(side) - 1))
            side[i], side[j] = side[j], side[i]

    def text(recs):
        return "".join(json.dumps(r) + "\n" for r in recs).encode()

    return _mutate_bytes(draw, text(rollout)), _mutate_bytes(draw, text(train))


@fast(500)
@given(pair=dump_pair())
def test_mutated_dumps_exit_0_1_or_2(space, monkeypatch, tic, tree_hash, pair):
    d, _ = space
    monkeypatch.chdir(d)
    (d / "r.jsonl").write_bytes(pair[0])
    (d / "t.jsonl").write_bytes(pair[1])
    before = tree_hash(d)
    code, _, err = tic("compare", str(d / "r.jsonl"), str(d / "t.jsonl"))
    assert code in (0, 1, 2), err
    if code == 2:
        assert len(err.strip().splitlines()) == 1
    assert tree_hash(d) == before


# ---- issue 27: outputs never name an input; exit 0 only on valid ids --------------------------------------------
TARGETS = ["tic.yaml", "model/config.json", "model/model.safetensors", "model/new.safetensors", "prompts.jsonl",
           "r.jsonl", "t.jsonl", "link-to-r", "hard-to-t", "model", ".", "fresh.xml", "state/results/C0.json",
           "state/results", "sub/fresh.xml", "model/report.xml"]
RUN_INPUTS = {"C5": ["tic.yaml", "r.jsonl", "t.jsonl"],
              "C0": ["tic.yaml", "model/config.json", "model/model.safetensors", "prompts.jsonl"]}
RUN_INPUTS["C2"] = RUN_INPUTS["C0"]


def _names_an_input(d: Path, target: str, inputs: list[str]) -> bool:
    real = Path(os.path.realpath(d / target))
    if real.exists() and any(real == Path(os.path.realpath(d / i)) or os.path.samefile(real, d / i) for i in inputs):
        return True
    return "model/config.json" in inputs and real.suffix == ".safetensors" and real.parent == (d / "model").resolve()


@fast(64)
@given(writer=st.sampled_from(["junit C0", "junit C5", "state_dir C0", "cut.out C2"]),
       target=st.sampled_from(TARGETS))
def test_outputs_never_replace_inputs(space, monkeypatch, tic, tree_hash, writer, target):
    """Every writer pointed at every kind of path: an input is never replaced (exit 2, one line), and whatever
    the exit, each input file stays byte for byte as it was; never exit 3."""
    d, _ = space
    monkeypatch.chdir(d)
    for name in ("r.jsonl", "t.jsonl"):
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in records()))
    for link, to, make in (("link-to-r", "r.jsonl", os.symlink), ("hard-to-t", "t.jsonl", os.link)):
        if not os.path.lexists(d / link):
            make(d / to, d / link)
    shutil.rmtree(d / "state", ignore_errors=True)
    shutil.rmtree(d / "sub", ignore_errors=True)
    kind, gate = writer.split()
    body = ("rollout: {engine: dump, dump: r.jsonl}\ntrain: {engine: dump, dump: t.jsonl}\nlocate: {enabled: false}\n"
            if gate == "C5" else "model: {path: model}\nprompts: {source: file, file: prompts.jsonl}\n")
    body += "state_dir: state\n" if kind != "state_dir" else f"state_dir: '{target}'\n"
    if kind == "cut.out":
        body += f"cut: {{out: '{target}'}}\n"
    (d / "tic.yaml").write_text(body)
    inputs = {i: (d / i).read_bytes() for i in RUN_INPUTS[gate]}
    if kind == "junit":
        code, _, err = tic("gate", gate, "-c", "tic.yaml", "--junit", target)
    elif kind == "cut.out":  # the preflight alone: C2 itself loads the model twice
        code = _validate_gates(d / "tic.yaml", ["C2"])
        err = ""
    else:
        code, _, err = tic("gate", gate, "-c", "tic.yaml")
    assert code in (0, 1, 2), err
    if code == 2 and err:
        assert len(err.strip().splitlines()) == 1, err
    assert {i: (d / i).read_bytes() for i in RUN_INPUTS[gate]} == inputs
    if kind in ("junit", "cut.out") and _names_an_input(d, target, RUN_INPUTS[gate]):
        assert code == 2, (writer, target)


def _validate_gates(cfg_path: Path, gate_ids: list[str]) -> int:
    from tic.config.schema import load_config
    from tic.gates import get
    from tic.skill.context import GateContext
    from tic.skill.preflight import validate_run

    try:
        validate_run(GateContext(load_config(cfg_path)), [get(g) for g in gate_ids])
    except TicInputError as e:
        assert str(e).strip() and len(str(e).splitlines()) == 1
        return 2
    return 0


ID_VALUES = [0, 5, -1, 2**53, 2**53 + 1, 2**63 - 1, 2**63, 2**64, True, False, 1.0, "5", None]


def _valid_id(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63


@fast(150)
@given(where=st.sampled_from(["prompt_ids", "response_ids", "id", "logprobs"]), value=st.sampled_from(ID_VALUES),
       both=st.booleans())
def test_compare_passes_only_on_ids_that_are_ids(space, monkeypatch, tic, where, value, both):
    """exit 0 only on valid input: a token id that is not one (negative, past int64, a bool, a float), a record
    id true (which would pair with 1), a logprob float64 cannot hold exactly: exit 2 with one line, never 0."""
    d, _ = space
    monkeypatch.chdir(d)
    sides = [records(1), records(1)]
    for recs in sides if both else sides[:1]:
        if where == "id":
            recs[0]["id"] = value
        elif where == "logprobs":
            recs[0]["logprobs"][0] = -value if isinstance(value, (int, float)) and not isinstance(value, bool) else value
        else:
            recs[0][where][0] = value
    for name, recs in zip(("r.jsonl", "t.jsonl"), sides):
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in recs))
    code, _, err = tic("compare", "r.jsonl", "t.jsonl")
    assert code in (0, 1, 2), err
    valid = {"id": value is None or isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)),
             "logprobs": (isinstance(value, (int, float)) and not isinstance(value, bool)
                          and float(-value) == -value),
             }.get(where, _valid_id(value))
    if not valid:
        assert code == 2 and len(err.strip().splitlines()) == 1, (where, value, code, err)
