"""Errors that map to the CLI's exit codes, and where an error was raised."""

import traceback
from pathlib import Path


class TicInputError(Exception):
    """Bad input (config, dump, model files): one clear line, exit code 2, state untouched."""

    exit_code = 2


EXIT_PASS = 0
EXIT_FAIL = 1
EXIT_INPUT = 2
EXIT_INTERNAL = 3


def raised_at(e: BaseException, frames: int = 3) -> str:
    """Where e was raised, innermost frame first: "file.py:12 fn <- caller.py:40 outer" (for one-line records)."""
    tb = traceback.extract_tb(e.__traceback__)[-frames:]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(tb))
