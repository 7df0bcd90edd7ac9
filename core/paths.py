"""Paths as a run resolves them, for the checks that keep every output off every input (symbolic links followed)."""

from __future__ import annotations

import os
from pathlib import Path


def real_path(p) -> Path:
    return Path(os.path.realpath(p))


def is_within(p: Path, d: Path) -> bool:
    """Whether real path p is d or lies under it (both already real paths)."""
    return p == d or d in p.parents
