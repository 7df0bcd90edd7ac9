"""Environment variables set for the duration of a block."""

from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def env_overlay(env: dict[str, str]):
    """Set env vars for the duration of the block, restored afterwards (a C1/C10 side's build and passes, the start
    of an engine process with switches of its own)."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
