"""Prompts as token ids: seeded random ones, or a JSONL file."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tic.core.errors import TicInputError
from tic.core.fsio import read_input_text
from tic.harness.engines.dump import is_token_id


def random_prompts(count: int, vocab_size: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (count,), generator=g).tolist()
    # avoid the first ids, where special tokens usually live
    low = min(4, vocab_size - 1)
    return [torch.randint(low, vocab_size, (n,), generator=g).tolist() for n in lens]


def file_prompts(path: Path, vocab_size: int) -> list[list[int]]:
    text = read_input_text(path, "prompts file")
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as e:
            raise TicInputError(f"{path}:{n}: not valid JSON ({getattr(e, 'msg', e)})") from None
        ids = obj.get("prompt_ids") if isinstance(obj, dict) else obj
        if not isinstance(ids, list) or not ids or not all(is_token_id(i) for i in ids):
            raise TicInputError(f"{path}:{n}: expected a non-empty list of token ids")
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise TicInputError(f"{path}:{n}: token id {bad[0]} outside the vocabulary (size {vocab_size})")
        out.append(ids)
    if not out:
        raise TicInputError(f"{path}: no prompts")
    return out
