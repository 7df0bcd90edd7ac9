"""Batch layouts the gates compare, built in one place so a gate and the locator's rerun agree exactly (the
micro-batches a training engine forms are its own: tic.harness.engines.batches)."""

from __future__ import annotations


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
