"""Atomic file writes (readers see the old or the new file, never half of one), and input files opened so that
whatever the system refuses is the user's input error (one line, exit 2), not an internal one."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from tic.core.errors import TicInputError


def require_input_file(path: Path, what: str) -> Path:
    """path must be a regular file (a FIFO would block the run, a directory is no file): else one clear line."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise TicInputError(f"{what} not found: {path}") from None
    except OSError as e:
        raise TicInputError(f"{what} {path}: cannot read ({e.strerror or e})") from None
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise TicInputError(f"{what} {path} is {kind}")
    return path


def open_input(path: Path, what: str):
    """A regular input file opened for reading in binary; any OSError becomes one clear input error."""
    require_input_file(path, what)
    try:
        return Path(path).open("rb")
    except OSError as e:
        raise TicInputError(f"{what} {path}: cannot read ({e.strerror or e})") from None


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file beside `path`, then rename: readers see the old or the new file, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def read_input_text(path: Path, what: str) -> str:
    """A whole input file as UTF-8 text; unreadable or not UTF-8 is one clear input error."""
    with open_input(path, what) as f:
        try:
            raw = f.read()
        except OSError as e:
            raise TicInputError(f"{what} {path}: cannot read ({e.strerror or e})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TicInputError(f"{path}: not UTF-8 text (byte {e.start})") from None
