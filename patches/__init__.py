"""Bundled patches: fixes for the rollout engine (vLLM) and the Megatron-core trainer that tic applies by name,
never by editing site-packages.

Each patch is one module under `tic.patches.<target>` that defines `PATCH`, a `tic.patches.base.Patch`: its
metadata (target package and versions, symptom, gate, guide, cost) and its `apply`/`revert`/`is_applied`.
They reach every vLLM process through vLLM's plugin entry point (`vllm.general_plugins` -> `tic.patches.plugin`),
which applies the names listed in the environment variable TIC_PATCHES; tic's own vLLM engine sets that variable
from `rollout: {patches: [...]}` in tic.yaml.
"""

from __future__ import annotations

import importlib
import pkgutil

from tic.core.errors import TicInputError
from tic.patches.base import Patch

ENV_VAR = "TIC_PATCHES"
_TARGETS = ("vllm", "megatron")


def registry() -> dict[str, Patch]:
    """Every bundled patch by name (metadata only: importing a patch module never imports its target)."""
    out: dict[str, Patch] = {}
    for target in _TARGETS:
        pkg = importlib.import_module(f"tic.patches.{target}")
        for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
            mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
            patch = getattr(mod, "PATCH", None)
            if isinstance(patch, Patch):
                if patch.name in out:
                    raise RuntimeError(f"two bundled patches are named {patch.name!r}")
                out[patch.name] = patch
    return out


def get(name: str) -> Patch:
    reg = registry()
    if name not in reg:
        raise TicInputError(f"unknown patch {name!r}; bundled patches: {', '.join(sorted(reg))}")
    return reg[name]


def conflict(names: list[str]) -> str | None:
    """Why `names` cannot be active together (two patches that replace the same function), or None."""
    reg = registry()
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if a in reg and b in reg and (b in reg[a].excludes or a in reg[b].excludes):
                return f"patches {a} and {b} replace the same vLLM function; list one of them"
    return None


def parse_names(text: str | None) -> list[str]:
    """TIC_PATCHES: names separated by commas or spaces; unknown names, or two that exclude each other, are an
    input error."""
    names = list(dict.fromkeys(n for n in (text or "").replace(",", " ").split() if n))
    for n in names:
        get(n)
    why = conflict(names)
    if why:
        raise TicInputError(why)
    return names


def apply(names: list[str]) -> list[str]:
    """Make exactly `names` active among the bundled patches for their targets (idempotent); returns them.
    A patch whose target is not installed at a supported version is refused before anything changes."""
    reg = registry()
    wanted = [get(n) for n in names]
    why = conflict(names)
    if why:
        raise TicInputError(why)
    for p in wanted:
        p.check_target()
    for p in reg.values():
        if p.name not in names and p.target_installed() and p.is_applied():
            p.revert()
    for p in wanted:
        if not p.is_applied():
            p.apply()
    return [p.name for p in wanted]


def choices() -> dict[str, dict]:
    """Per active patch with run-time choices, what it chose in this process (Patch.choices)."""
    return {n: c for n in active() if (c := registry()[n].choices())}


def active() -> list[str]:
    """Names of the bundled patches active in this process, read from the patched objects themselves."""
    return [p.name for p in registry().values() if p.target_installed() and p.is_applied()]
