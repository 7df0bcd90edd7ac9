"""vLLM's plugin entry point (group `vllm.general_plugins`): vLLM calls `load` in every process it starts.

It applies the bundled patches named in TIC_PATCHES, so an RL job that tic does not start gets the same
fixes by setting one environment variable. A bad name or an unsupported vLLM version stops the process with
the reason: running unpatched while the user asked for a patch would be a silent false pass."""

from __future__ import annotations

import os


def load() -> None:
    from tic import patches

    names = patches.parse_names(os.environ.get(patches.ENV_VAR))
    if names:
        patches.apply(names)
