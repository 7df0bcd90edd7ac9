"""Content hashes of the inputs a gate read besides the model (prompts file, dumps, the cut): stored in its
record, recomputed by `tic status`, so a changed input marks the record stale even when no path changed."""

from __future__ import annotations

from tic.core.content_hash import file_hash, files_hash
from tic.config.schema import TicConfig
from tic.gates.c2 import cut_request
from tic.skill.state import LadderState

ALL_READS = ("model", "rollout", "train", "prompts", "layouts", "cut")


def reads_of(gate) -> tuple[str, ...]:
    return ALL_READS if gate.reads is None else tuple(gate.reads)


def _hash(fn, arg) -> str:
    try:
        return fn(arg)
    except OSError:
        return "unreadable"  # differs from any hash: the record reads as stale, never as current


def input_hashes(cfg: TicConfig, reads: tuple[str, ...]) -> dict[str, str]:
    """name -> content hash of each input file the reads name that exists now (missing ones are left out)."""
    out: dict[str, str] = {}
    p = cfg.prompts
    if "prompts" in reads and p.source == "file" and cfg.rollout.engine != "dump":
        path = cfg.resolve(p.file)
        if path.is_file():
            out["prompts file"] = _hash(file_hash, path)
    for side in ("rollout", "train"):
        side_cfg = getattr(cfg, side)
        if side in reads and side_cfg.engine == "dump":
            path = cfg.resolve(side_cfg.dump)
            if path.is_file():
                out[f"{side} dump"] = _hash(file_hash, path)
    if "cut" in reads:
        d = cut_request(cfg, LadderState(cfg.state_path)).out
        files = sorted(f for f in d.glob("*") if f.is_file()) if d.is_dir() else []
        if files:
            out["cut"] = _hash(files_hash, files)
    return out
