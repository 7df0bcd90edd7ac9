"""Errors that map to the CLI's exit codes."""


class TicInputError(Exception):
    """Bad input (config, dump, model files): one clear line, exit code 2, state untouched."""

    exit_code = 2


EXIT_PASS = 0
EXIT_FAIL = 1
EXIT_INPUT = 2
EXIT_INTERNAL = 3
