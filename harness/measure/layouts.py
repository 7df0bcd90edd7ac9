"""Batch layouts the gates compare, built in one place so a gate and the locator's rerun agree exactly."""

from __future__ import annotations

import random


def probe_batch(prompts: list[list[int]], probe: int, size: int, position: str | int) -> tuple[list, list, int]:
    """C3: the probe request placed at `position` (first|middle|last or an index) among size-1 batch-mates.
    Returns (prompts, request ids, index of the probe). Mates get their own seeds; the probe keeps its id."""
    at = {"first": 0, "middle": size // 2, "last": size - 1}[position] if isinstance(position, str) else position
    others = [i for i in range(len(prompts)) if i != probe]
    mates = [others[k % len(others)] for k in range(size - 1)] if others else [probe] * (size - 1)
    batch_prompts = [prompts[i] for i in mates]
    batch_ids = [len(prompts) + 1000 * (k + 1) + i for k, i in enumerate(mates)]
    batch_prompts.insert(at, prompts[probe])
    batch_ids.insert(at, probe)
    return batch_prompts, batch_ids, at


def describe_train_layout(override: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in override.items()) or "as configured"


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
