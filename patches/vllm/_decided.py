"""Decisions a patch takes once per problem in a process, by a check it runs on seeded operands (which tile,
kernel or launch gives the reference bits), kept in a dict by problem key."""

from __future__ import annotations

from typing import Callable


def decided(taken: dict, key, decide: Callable[[], object], on_cuda: bool, while_capturing):
    """decide()'s result for key, run the first time key is seen and kept in taken. While a CUDA graph is being
    captured, an undecided key on the GPU gets while_capturing and stays undecided: deciding would launch work into
    the graph."""
    if key not in taken:
        import torch

        if on_cuda and torch.cuda.is_current_stream_capturing():
            return while_capturing
        taken[key] = decide()
    return taken[key]


def counts(taken: dict, yes: str, no: str) -> dict[str, int]:
    """How many of the yes/no decisions taken so far went each way ({} before the first)."""
    agreed = sum(bool(v) for v in taken.values())
    return {yes: agreed, no: len(taken) - agreed} if taken else {}
