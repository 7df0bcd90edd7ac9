"""The micro-batches a training engine forms from the sequences it scores, in its sequence order."""

from __future__ import annotations

import random


def sequence_order(n: int, order: str) -> list[int]:
    """The order in which a training engine takes n sequences (indices into them): as given, reversed, or one
    fixed seeded permutation in which no sequence keeps its place (the same for every run and process). A
    sequence then has other micro-batch mates, another row and another offset in a packed row."""
    idx = list(range(n))
    if order == "reversed":
        return idx[::-1]
    if order == "shuffled":
        rng, out = random.Random(0), idx
        while n > 1 and any(i == j for i, j in enumerate(out)):  # redrawn until every sequence moves (about e draws)
            out = idx[:]
            rng.shuffle(out)
        return out
    if order != "given":
        raise ValueError(f"unknown sequence order {order!r}")
    return idx


def micro_batches(n: int, size: int, order: str = "given") -> list[list[int]]:
    """The micro-batches (lists of sequence indices) a training engine forms from n sequences."""
    idx = sequence_order(n, order)
    return [idx[i:i + size] for i in range(0, n, size)]
