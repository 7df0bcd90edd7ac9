"""The frozen performance baseline on disk (C1; C10 measures against it).

A baseline directory holds:
  baseline.json   workload, baseline engine settings, environment fingerprint, per-pass throughput summary
  requests.jsonl  one raw record per request and pass
  freeze.json     sha256 of each file above and of the set (written by `tic baseline freeze`)
  approval.json   who approved which frozen hash, when (written by `tic baseline approve --by NAME`)
Any byte changed in baseline.json or requests.jsonl after freezing no longer matches freeze.json; a re-freeze
changes the hash, which the approval no longer matches. Either way C1 (and C10) fail.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from tic.config.schema import TicConfig
from tic.core.errors import TicInputError
from tic.core.fsio import atomic_write_text

DATA_FILES = ("baseline.json", "requests.jsonl")
FREEZE = "freeze.json"
APPROVAL = "approval.json"


def baseline_dir(cfg: TicConfig) -> Path:
    """Where the baseline lives: perf.baseline_dir (relative to tic.yaml), or STATE_DIR/baseline."""
    d = cfg.perf.baseline_dir
    return Path(cfg.resolve(d)) if d is not None else cfg.state_path / "baseline"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def file_hashes(directory: Path) -> dict[str, str]:
    return {name: hashlib.sha256((directory / name).read_bytes()).hexdigest()
            for name in DATA_FILES if (directory / name).is_file()}


def set_hash(hashes: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(hashes, sort_keys=True).encode()).hexdigest()


def write_baseline(directory: Path, record: dict, requests: list[dict], replace: bool = False) -> None:
    """Write a new, unfrozen baseline. A frozen one is only replaced on request (its freeze and approval go)."""
    if (directory / FREEZE).exists() and not replace:
        raise TicInputError(f"{directory} holds a frozen baseline; `tic baseline run --replace` discards it "
                            "(and its approval)")
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".baseline-", dir=directory.parent))
    try:
        (tmp / "baseline.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        (tmp / "requests.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in requests))
        old = None
        if directory.exists():
            old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
            os.replace(directory, old)
        os.replace(tmp, directory)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def freeze(directory: Path, by: str = "") -> dict:
    if not (directory / "baseline.json").is_file():
        raise TicInputError(f"no baseline in {directory}: run `tic baseline run` first")
    if (directory / FREEZE).exists():
        raise TicInputError(f"{directory} is already frozen; a new baseline needs `tic baseline run --replace`")
    hashes = file_hashes(directory)
    missing = [n for n in DATA_FILES if n not in hashes]
    if missing:
        raise TicInputError(f"baseline in {directory} lacks {', '.join(missing)}")
    rec = {"files": hashes, "hash": set_hash(hashes), "frozen_at": _now(), "frozen_by": by}
    atomic_write_text(directory / FREEZE, json.dumps(rec, indent=2) + "\n")
    return rec


def approve(directory: Path, by: str) -> dict:
    if not by.strip():
        raise TicInputError("approve needs --by NAME (the person who reviewed the baseline)")
    st = verify(directory)
    if not st.frozen:
        raise TicInputError(f"baseline in {directory} is not frozen: `tic baseline freeze` first")
    if st.problems:
        raise TicInputError(f"cannot approve: {st.problems[0]}")
    rec = {"by": by, "hash": st.hash, "approved_at": _now()}
    atomic_write_text(directory / APPROVAL, json.dumps(rec, indent=2) + "\n")
    return rec


@dataclass
class BaselineStatus:
    directory: str
    exists: bool = False
    frozen: bool = False
    approved: bool = False
    hash: str = ""
    approved_by: str = ""
    problems: list[str] = field(default_factory=list)  # the files: missing, unreadable, edited after freezing
    approval_problems: list[str] = field(default_factory=list)
    record: dict = field(default_factory=dict)
    next_step: str = ""  # the first step not yet taken (run, freeze, a person's approval), when one is missing

    @property
    def all_problems(self) -> list[str]:
        return self.problems + self.approval_problems

    @property
    def valid(self) -> bool:
        return self.exists and self.frozen and self.approved and not self.all_problems

    @property
    def waiting(self) -> bool:
        """Nothing is wrong with what exists; only a step is still to be taken (C1/C10 wait, they do not fail)."""
        return bool(self.next_step) and self.all_problems == [self.next_step]


def _read_json(path: Path, problems: list[str]) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        problems.append(f"{path.name} unreadable ({type(e).__name__})")
        return None
    if not isinstance(data, dict):
        problems.append(f"{path.name} is not a JSON object")
        return None
    return data


def _read_step(path: Path, missing: str, problems: list[str]) -> dict | None:
    """The record of one baseline step (freeze, approval), or None with the reason added to `problems`: `missing`
    when the file is absent, else why it cannot be read."""
    if not path.is_file():
        problems.append(missing)
        return None
    return _read_json(path, problems)


def verify(directory: Path) -> BaselineStatus:
    """Is the baseline there, frozen, approved, and are its files still the frozen bytes?"""
    st = BaselineStatus(str(directory))
    st.exists = (directory / "baseline.json").is_file()
    if not st.exists:
        st.next_step = f"no baseline in {directory} (`tic baseline run`)"
        st.problems.append(st.next_step)
        return st
    rec = _read_json(directory / "baseline.json", st.problems)
    st.record = rec or {}
    fr = _read_step(directory / FREEZE, "baseline not frozen (`tic baseline freeze`)", st.problems)
    if fr is None:
        if not (directory / FREEZE).is_file():
            st.next_step = st.problems[-1]
        return st
    st.frozen = True
    st.hash = str(fr.get("hash", ""))
    frozen_files = fr.get("files") or {}
    if set(frozen_files) != set(DATA_FILES) or set_hash(frozen_files) != st.hash:
        st.problems.append("freeze.json does not hash the baseline files it lists (edited after freezing)")
    now = file_hashes(directory)
    for name in DATA_FILES:
        if name not in now:
            st.problems.append(f"{name} missing since the freeze")
        elif now[name] != frozen_files.get(name):
            st.problems.append(f"{name} changed after the freeze (sha256 {now[name][:12]} vs frozen "
                               f"{str(frozen_files.get(name))[:12]})")
    ap = _read_step(directory / APPROVAL, "frozen baseline not approved (`tic baseline approve --by NAME`)",
                    st.approval_problems)
    if ap is None:
        if not (directory / APPROVAL).is_file():
            st.next_step = st.approval_problems[-1]
        return st
    st.approved_by = str(ap.get("by", ""))
    if ap.get("hash") != st.hash:
        st.approval_problems.append(f"the approval ({st.approved_by}) is for another baseline hash; re-approve "
                                    "after review")
    elif not st.approved_by.strip():
        st.approval_problems.append("the approval names no one")
    else:
        st.approved = True
    return st
