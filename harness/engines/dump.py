"""Dump engine: rollout or train logprobs recorded by any RL framework, one JSON object per line.

Schema (one line per sequence):
  prompt_ids      list[int]            required
  response_ids    list[int]            required, non-empty
  logprobs        list[float]          required, one per response token (JSON numbers; NaN/Infinity rejected)
  mask            list[0|1|bool]       optional, 1 = valid token (inside the response mask); default all valid
  weight_version  int                  optional; rollout and train must agree where both give it
  id              str | int            optional; when both dumps carry ids, sequences are matched by id

Floats are read as float64, which holds every float32 exactly, so a producer that writes repr(float(x))
keeps the bits.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from tic.harness.engines.base import Engine, Sample, Sampling
from tic.core.errors import TicInputError

REQUIRED = ("prompt_ids", "response_ids", "logprobs")
KNOWN = set(REQUIRED) | {"mask", "weight_version", "id"}


def _int_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in v)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a number")


def parse_line(line: str, where: str) -> Sample:
    try:
        obj = json.loads(line, parse_constant=_reject_constant)
    except ValueError as e:
        msg = str(e) if "not a number" in str(e) else f"not valid JSON ({getattr(e, 'msg', e)})"
        raise TicInputError(f"{where}: {msg}") from None
    if not isinstance(obj, dict):
        raise TicInputError(f"{where}: expected a JSON object")
    missing = [k for k in REQUIRED if k not in obj]
    if missing:
        raise TicInputError(f"{where}: missing field '{missing[0]}'")
    unknown = sorted(set(obj) - KNOWN)
    if unknown:
        raise TicInputError(f"{where}: unknown field '{unknown[0]}'")
    if not _int_list(obj["prompt_ids"]):
        raise TicInputError(f"{where}: prompt_ids must be a list of integers")
    if not _int_list(obj["response_ids"]) or not obj["response_ids"]:
        raise TicInputError(f"{where}: response_ids must be a non-empty list of integers")
    lps = obj["logprobs"]
    if not isinstance(lps, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in lps):
        raise TicInputError(f"{where}: logprobs must be a list of numbers")
    n = len(obj["response_ids"])
    if len(lps) != n:
        raise TicInputError(f"{where}: length mismatch: {n} response_ids but {len(lps)} logprobs")
    for j, x in enumerate(lps):
        if not math.isfinite(x):
            raise TicInputError(f"{where}: logprob {j} is {x}")
    mask = None
    if obj.get("mask") is not None:
        m = obj["mask"]
        if not isinstance(m, list) or len(m) != n or not all(x in (0, 1) for x in m):
            raise TicInputError(f"{where}: mask must be a list of {n} values 0/1")
        mask = torch.tensor([bool(x) for x in m])
    wv = obj.get("weight_version")
    if wv is not None and (not isinstance(wv, int) or isinstance(wv, bool)):
        raise TicInputError(f"{where}: weight_version must be an integer")
    sid = obj.get("id")
    if sid is not None and not isinstance(sid, (str, int)):
        raise TicInputError(f"{where}: id must be a string or an integer")
    return Sample(obj["prompt_ids"], obj["response_ids"], torch.tensor(lps, dtype=torch.float64), mask, wv, sid,
                  meta={"source": where})


def read_dump(path: Path) -> list[Sample]:
    path = Path(path)
    if not path.is_file():
        raise TicInputError(f"dump file not found: {path}")
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise TicInputError(f"{path}: not a UTF-8 text file") from None
    out = [parse_line(line, f"{path}:{n}") for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not out:
        raise TicInputError(f"{path}: no records")
    ids = [s.id for s in out if s.id is not None]
    if len(ids) != len(set(ids)):
        raise TicInputError(f"{path}: duplicate id")
    return out


def write_dump(path: Path, samples: list[Sample]) -> None:
    """Write samples in the dump schema (floats as Python reprs: exact)."""
    from tic.core.fsio import atomic_write_text

    lines = []
    for s in samples:
        rec = {"prompt_ids": list(s.prompt_ids), "response_ids": list(s.response_ids),
               "logprobs": [float(x) for x in s.logprobs.tolist()]}
        if s.mask is not None:
            rec["mask"] = [int(x) for x in s.mask.tolist()]
        if s.weight_version is not None:
            rec["weight_version"] = s.weight_version
        if s.id is not None:
            rec["id"] = s.id
        lines.append(json.dumps(rec))
    atomic_write_text(Path(path), "\n".join(lines) + "\n")


def align(rollout: list[Sample], train: list[Sample], train_name: str = "train") -> list[Sample]:
    """Train records in rollout order (by id when both carry ids, else by line); tokens must match exactly."""
    if all(s.id is not None for s in rollout) and all(s.id is not None for s in train):
        by_id = {s.id: s for s in train}
        missing = [s.id for s in rollout if s.id not in by_id]
        if missing:
            raise TicInputError(f"{train_name} has no sequence with id {missing[0]!r}")
        matched = [by_id[s.id] for s in rollout]
    else:
        if len(rollout) != len(train):
            raise TicInputError(f"sequence count mismatch: rollout has {len(rollout)}, {train_name} has {len(train)}")
        matched = train
    for i, (r, t) in enumerate(zip(rollout, matched)):
        if list(r.prompt_ids) != list(t.prompt_ids) or list(r.response_ids) != list(t.response_ids):
            raise TicInputError(f"sequence {i}: token ids differ between rollout and {train_name}; "
                                "diff is defined on identical tokens")
        if r.weight_version is not None and t.weight_version is not None and r.weight_version != t.weight_version:
            raise TicInputError(f"sequence {i}: weight_version {r.weight_version} (rollout) vs "
                                f"{t.weight_version} ({train_name}); diff is defined under one weight version")
        # The response mask belongs to the rollout record; a train-side mask must agree with it or stand alone.
        if t.mask is not None:
            if r.mask is None:
                r.mask = t.mask
            elif not torch.equal(r.mask, t.mask):
                raise TicInputError(f"sequence {i}: the response mask differs between rollout and {train_name}")
    return matched


class DumpEngine(Engine):
    name = "dump"

    def __init__(self, path: Path, side: str = "rollout"):
        self.path = Path(path)
        self.side = side
        self.samples = read_dump(self.path)

    def dumped_samples(self) -> list[Sample]:
        return self.samples

    def score(self, samples: list[Sample], sampling: Sampling) -> list[torch.Tensor]:
        return [s.logprobs for s in align(samples, self.samples, f"{self.side} dump {self.path.name}")]
