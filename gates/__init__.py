"""The C0-C10 ladder. One module per gate; this registry lists them in climbing order."""

from __future__ import annotations

from tic.gates import c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10
from tic.gates.base import Gate, Judgement, Measurement, Verdict
from tic.core.errors import TicInputError

REGISTRY: list[Gate] = [m.GATE for m in (c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10)]
BY_ID: dict[str, Gate] = {g.id: g for g in REGISTRY}

__all__ = ["REGISTRY", "BY_ID", "Gate", "Judgement", "Measurement", "Verdict", "get", "gate_range"]


def get(gate_id: str) -> Gate:
    gid = gate_id.upper()
    if gid not in BY_ID:
        raise TicInputError(f"unknown gate {gate_id!r}; gates are {', '.join(BY_ID)}")
    return BY_ID[gid]


def gate_range(start: str = "C0", stop: str = "C10") -> list[Gate]:
    a, b = REGISTRY.index(get(start)), REGISTRY.index(get(stop))
    if a > b:
        raise TicInputError(f"--from {start} comes after --to {stop}")
    return REGISTRY[a:b + 1]
