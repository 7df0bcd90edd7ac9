"""One bundled patch: metadata plus apply / revert / is_applied on the live objects of its target package."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from importlib import metadata
from typing import Callable

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tic.core.errors import TicInputError


@dataclass(frozen=True)
class Patch:
    name: str
    target: str                 # the distribution it changes, e.g. "vllm"
    versions: str               # PEP 440 specifier of the target versions it was written and checked against
    gate: str                   # the gate it makes pass, e.g. "C4"
    symptom: str                # what the locator prints when this patch is the fix
    fix: str                    # what it changes, in one or two sentences
    guide: str                  # the guide that names it, relative to the package root
    cost: str                   # measured cost, or what it costs in principle until measured
    excludes: tuple = ()        # patches that change the same function and so cannot be active with this one
    module: str = ""            # the target's import name where it is not the distribution's (megatron.core)
    engine: str = ""            # the tic engine whose config lists it, where not the target (megatron)
    _apply: Callable[[], None] = field(repr=False, default=lambda: None)
    _revert: Callable[[], None] = field(repr=False, default=lambda: None)
    _is_applied: Callable[[], bool] = field(repr=False, default=lambda: False)
    _choices: Callable[[], dict] = field(repr=False, default=lambda: {})

    def installed_version(self) -> str | None:
        try:
            return metadata.version(self.target)
        except metadata.PackageNotFoundError:
            try:  # a target on PYTHONPATH without dist-info (e.g. an unpacked bundle)
                return getattr(importlib.import_module(self.module or self.target), "__version__", None)
            except ImportError:
                return None

    def target_installed(self) -> bool:
        v = self.installed_version()
        return v is not None and Version(v) in SpecifierSet(self.versions)

    def check_target(self) -> None:
        v = self.installed_version()
        if v is None:
            raise TicInputError(f"patch {self.name}: {self.target} is not installed (needs {self.target}{self.versions})")
        if Version(v) not in SpecifierSet(self.versions):
            raise TicInputError(f"patch {self.name}: installed {self.target} {v} is outside {self.versions}; "
                                "refusing to patch a version it was not checked against")

    def apply(self) -> None:
        self.check_target()
        self._apply()
        if not self._is_applied():
            raise RuntimeError(f"patch {self.name}: applied but not visible in {self.target}")

    def revert(self) -> None:
        self._revert()

    def is_applied(self) -> bool:
        """Read from the target's live objects; a target this process never imported is unpatched."""
        import sys

        return (self.module or self.target) in sys.modules and bool(self._is_applied())

    def choices(self) -> dict:
        """What the patch decided at run time in this process so far, for a patch whose kernel choice rests on a
        check it runs (e.g. how many problems passed it); {} for the others."""
        return self._choices()

    def describe(self) -> dict:
        return {"name": self.name, "target": f"{self.target}{self.versions}", "gate": self.gate,
                "symptom": self.symptom, "fix": self.fix, "guide": self.guide, "cost": self.cost}
