"""Dump engine: rollout or train logprobs recorded by any RL framework, one JSON object per line.

Schema (one line per sequence):
  prompt_ids      list[int]            required
  response_ids    list[int]            required, non-empty
  logprobs        list[float]          required, one per response token, each <= 0 (JSON numbers; NaN/Infinity
                                       rejected)
  mask            list[0|1|bool]       optional, 1 = valid token (inside the response mask); default all valid
  weight_version  int                  optional; rollout and train must agree where both give it
  id              str | int            optional; unique within a file

Pairing (rollout record <-> train record): when the first record of both files carries an id, every record of
both must carry one and records pair by id (any order); otherwise they pair by line. Either way each record
pairs with exactly one record of the other file: a missing or extra record is an input error, as is a pair
whose token ids, weight versions or masks disagree.

Files are read line by line, both together, so memory does not grow with the dump. Floats are read as float64,
which holds every float32 exactly, so a producer that writes repr(float(x)) keeps the bits.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from tic.harness.engines.base import Engine, Sample, Sampling
from tic.harness.kernels.spec import DEFAULT_KV_BLOCK_SIZE, RolloutKernels
from tic.core.errors import TicInputError
from tic.core.fsio import open_input

REQUIRED = ("prompt_ids", "response_ids", "logprobs")
KNOWN = set(REQUIRED) | {"mask", "weight_version", "id"}


INT64_MAX = 2**63 - 1


def is_token_id(v) -> bool:
    """A token id: an integer (never a bool) in [0, 2^63), so it fits the int64 tensors engines build."""
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= INT64_MAX


def _int_list(v) -> bool:
    return isinstance(v, list) and all(is_token_id(i) for i in v)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a number")


def parse_line(line: str, where: str) -> Sample:
    try:
        obj = json.loads(line, parse_constant=_reject_constant)
    except RecursionError:
        raise TicInputError(f"{where}: not valid JSON (nested too deeply)") from None
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
        raise TicInputError(f"{where}: prompt_ids must be a list of token ids (integers in [0, 2^63))")
    if not _int_list(obj["response_ids"]) or not obj["response_ids"]:
        raise TicInputError(f"{where}: response_ids must be a non-empty list of token ids (integers in [0, 2^63))")
    lps = obj["logprobs"]
    if not isinstance(lps, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in lps):
        raise TicInputError(f"{where}: logprobs must be a list of numbers")
    n = len(obj["response_ids"])
    if len(lps) != n:
        raise TicInputError(f"{where}: length mismatch: {n} response_ids but {len(lps)} logprobs")
    for j, x in enumerate(lps):
        try:
            v = float(x)
        except OverflowError:
            raise TicInputError(f"{where}: logprob {j} is an integer too large for a float") from None
        if isinstance(x, int) and int(v) != x:  # two such integers that differ in the file would compare equal
            raise TicInputError(f"{where}: logprob {j} is the integer {x}, which float64 cannot hold exactly")
        if not math.isfinite(v):
            raise TicInputError(f"{where}: logprob {j} is {v}")
        if v > 0:
            raise TicInputError(f"{where}: logprob {j} is {x!r}, above 0 (a log-probability is at most 0)")
    mask = None
    if obj.get("mask") is not None:
        m = obj["mask"]
        if not isinstance(m, list) or len(m) != n or not all(x in (0, 1) for x in m):
            raise TicInputError(f"{where}: mask must be a list of {n} values 0/1")
        mask = torch.tensor([bool(x) for x in m])
    wv = obj.get("weight_version")
    if wv is not None and (not isinstance(wv, int) or isinstance(wv, bool) or abs(wv) > INT64_MAX):
        raise TicInputError(f"{where}: weight_version must be an integer")
    sid = obj.get("id")
    if sid is not None and (isinstance(sid, bool) or not isinstance(sid, (str, int))):
        raise TicInputError(f"{where}: id must be a string or an integer")  # true would pair with 1
    return Sample(obj["prompt_ids"], obj["response_ids"], torch.tensor([float(x) for x in lps], dtype=torch.float64),
                  mask, wv, sid,
                  meta={"source": where})


def _read_lines(f, path: Path) -> Iterator[tuple[int, bytes]]:
    n = 0
    while True:
        try:
            raw = f.readline()
        except OSError as e:
            raise TicInputError(f"dump file {path}: cannot read ({e.strerror or e})") from None
        if not raw:
            return
        n += 1
        yield n, raw


def _lines(path: Path) -> Iterator[tuple[int, int, str]]:
    """(line number, byte offset, text) of each non-blank line, read one at a time."""
    path = Path(path)
    offset = 0
    with open_input(path, "dump file") as f:
        for n, raw in _read_lines(f, path):
            start, offset = offset, offset + len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise TicInputError(f"{path}:{n}: not UTF-8 text") from None
            if line.strip():
                yield n, start, line


def iter_dump(path: Path) -> Iterator[Sample]:
    """Records one at a time, each checked; ids must be unique within the file."""
    seen: set = set()
    count = 0
    for n, _, line in _lines(path):
        s = parse_line(line, f"{path}:{n}")
        if s.id is not None:
            if s.id in seen:
                raise TicInputError(f"{path}:{n}: duplicate id {s.id!r}")
            seen.add(s.id)
        count += 1
        yield s
    if count == 0:
        raise TicInputError(f"{path}: no records")


def read_dump(path: Path) -> list[Sample]:
    return list(iter_dump(path))


def check_dump(path: Path) -> int:
    """Read a whole dump once, checking every record (nothing kept); returns the record count."""
    return sum(1 for _ in iter_dump(path))


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


def _check_pair(i: int, r: Sample, t: Sample, train_name: str) -> None:
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


class _TrainIndex:
    """Byte offset of each train record by id: built only when ids come in another order than the rollout's."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.offsets: dict = {}
        for s, (n, off, _) in zip(iter_dump(self.path), _lines(self.path)):
            if s.id is None:
                raise TicInputError(f"{self.path}:{n}: record without id in a dump whose records carry ids")
            self.offsets[s.id] = (n, off)
        self.file = self.path.open("rb")

    def get(self, sid) -> Sample | None:
        if sid not in self.offsets:
            return None
        n, off = self.offsets[sid]
        self.file.seek(off)
        return parse_line(self.file.readline().decode("utf-8"), f"{self.path}:{n}")

    def close(self) -> None:
        self.file.close()


def pair_with_dump(rollout: Iterable[Sample], train_path: Path, train_name: str = "train") -> Iterator[tuple[Sample, Sample]]:
    """(rollout record, train record) pairs under the pairing rules above, streamed from the train file."""
    train_path = Path(train_path)
    train = iter_dump(train_path)
    rollout = iter(rollout)
    r0, t0 = next(rollout, None), next(train, None)
    if r0 is None:
        raise TicInputError("the rollout has no records")
    by_id = r0.id is not None and t0.id is not None
    i, used, index = 0, set(), None
    r, t = r0, t0
    try:
        while r is not None:
            if by_id and r.id is None:
                raise TicInputError(f"rollout sequence {i} has no id, but the records carry ids")
            if index is None and t is None:
                raise TicInputError(f"{train_name} has fewer records than the rollout (none for rollout "
                                    f"sequence {i}{'' if r.id is None else f', id {r.id!r}'})")
            if by_id and index is None and t.id != r.id:
                if t.id is None:
                    raise TicInputError(f"{train_name} record {i + 1} has no id, but the records carry ids")
                index = _TrainIndex(train_path)  # other order: look each id up from here on
            if by_id and r.id in used:
                raise TicInputError(f"rollout id {r.id!r} appears twice")
            if index is not None:
                t = index.get(r.id)
                if t is None:
                    raise TicInputError(f"{train_name} has no sequence with id {r.id!r}")
            if by_id:
                used.add(r.id)
            _check_pair(i, r, t, train_name)
            yield r, t
            i += 1
            r = next(rollout, None)
            if index is None:
                t = next(train, None)
        if index is not None:
            extra = [sid for sid in index.offsets if sid not in used]
            if extra:
                raise TicInputError(f"{train_name} has a record with no rollout counterpart (id {extra[0]!r}); "
                                    "every record must pair with exactly one")
        elif t is not None:
            raise TicInputError(f"{train_name} has more records than the rollout ({i}); the extra one is "
                                f"{t.meta.get('source', '')}{'' if t.id is None else f' (id {t.id!r})'}")
    finally:
        if index is not None:
            index.close()


def align(rollout: list[Sample], train_path: Path, train_name: str = "train") -> list[Sample]:
    """Train records in rollout order, paired and checked (see the pairing rules above)."""
    return [t for _, t in pair_with_dump(rollout, train_path, train_name)]


class DumpEngine(Engine):
    name = "dump"

    def __init__(self, path: Path, side: str = "rollout", options: dict | None = None):
        """options: what the config says of the vLLM that wrote a rollout dump (config.schema.DUMP_OPTIONS)."""
        self.path = Path(path)
        self.side = side
        self.options = dict(options or {})
        if not self.path.is_file():
            raise TicInputError(f"dump file not found: {self.path}")
        self._samples: list[Sample] | None = None

    @property
    def rollout_kernels(self) -> RolloutKernels:
        """What a training side on vLLM's kernels must match of the rollout that wrote this dump: vLLM's defaults
        (page size 16, the V1 runner's logprobs) where the config does not say."""
        o = self.options
        return RolloutKernels.of_runner(int(o.get("kv_block_size") or DEFAULT_KV_BLOCK_SIZE),
                                        o.get("model_runner") == "v2")

    def dumped_samples(self) -> list[Sample]:
        if self._samples is None:
            self._samples = read_dump(self.path)
        return self._samples

    def score(self, samples: list[Sample], sampling: Sampling) -> list[torch.Tensor]:
        return [t.logprobs for t in align(samples, self.path, f"{self.side} dump {self.path.name}")]
