"""Swap a module-level function everywhere vLLM bound it, and put it back: the one mechanism the patches share."""

from __future__ import annotations

import importlib
import sys
from typing import Callable

_MARK = "__tic_patch__"


def _wrapped(original: Callable, make: Callable[[Callable], Callable], name: str) -> Callable | None:
    """make(original), marked as patch `name`'s and holding the original; None when original already is it."""
    if getattr(original, _MARK, None) == name:
        return None
    wrapped = make(original)
    setattr(wrapped, _MARK, name)
    wrapped.__wrapped__ = original
    return wrapped


def swap_everywhere(home: str, attr: str, make: Callable[[Callable], Callable], name: str, prefix: str) -> None:
    """Replace `home.attr` by `make(original)` in `home` and in every loaded module under `prefix` that imported
    it by name (`from home import attr`). Modules imported later read the patched attribute from `home`."""
    mod = importlib.import_module(home)
    original = getattr(mod, attr)
    wrapped = _wrapped(original, make, name)
    if wrapped is None:
        return
    for m in list(sys.modules.values()):
        if m is not None and getattr(m, "__name__", "").startswith(prefix) and getattr(m, attr, None) is original:
            setattr(m, attr, wrapped)
    setattr(mod, attr, wrapped)


def restore_everywhere(home: str, attr: str, name: str, prefix: str) -> None:
    mod = sys.modules.get(home)
    if mod is None:
        return
    wrapped = getattr(mod, attr)
    if getattr(wrapped, _MARK, None) != name:
        return
    original = wrapped.__wrapped__
    for m in list(sys.modules.values()):
        if m is not None and getattr(m, "__name__", "").startswith(prefix) and getattr(m, attr, None) is wrapped:
            setattr(m, attr, original)


def is_swapped(home: str, attr: str, name: str) -> bool:
    try:
        mod = importlib.import_module(home)
    except ImportError:
        return False
    return getattr(getattr(mod, attr, None), _MARK, None) == name


def _owner(home: str, cls: str):
    return getattr(importlib.import_module(home), cls)


def swap_method(home: str, cls: str, attr: str, make: Callable[[Callable], Callable], name: str) -> None:
    """Replace the method `home.cls.attr` by `make(original)`; instances made afterwards (vLLM binds a CustomOp's
    forward at construction) and calls through the class see it. A classmethod's function is wrapped (make gets
    and returns a function of (cls, ...)) and stays a classmethod."""
    owner = _owner(home, cls)
    raw = owner.__dict__.get(attr)
    if isinstance(raw, classmethod):
        wrapped = _wrapped(raw.__func__, make, name)
        if wrapped is not None:
            setattr(owner, attr, classmethod(wrapped))
        return
    wrapped = _wrapped(getattr(owner, attr), make, name)
    if wrapped is not None:
        wrapped.__tic_inherited__ = raw is None  # a base class's method: revert removes the override
        setattr(owner, attr, wrapped)


def restore_method(home: str, cls: str, attr: str, name: str) -> None:
    owner = _owner(home, cls)
    raw = owner.__dict__.get(attr)
    if isinstance(raw, classmethod):
        if getattr(raw.__func__, _MARK, None) == name:
            setattr(owner, attr, classmethod(raw.__func__.__wrapped__))
        return
    wrapped = getattr(owner, attr)
    if getattr(wrapped, _MARK, None) == name:
        if getattr(wrapped, "__tic_inherited__", False):
            delattr(owner, attr)
        else:
            setattr(owner, attr, wrapped.__wrapped__)


def method_swapped(home: str, cls: str, attr: str, name: str) -> bool:
    try:
        return getattr(getattr(_owner(home, cls), attr), _MARK, None) == name
    except (ImportError, AttributeError):
        return False


def swap_hooks(name: str, *swaps: tuple[str, str, Callable[[Callable], Callable], str],
               methods: tuple[tuple[str, str, str, Callable[[Callable], Callable]], ...] = ()) -> dict:
    """A Patch's `_apply`, `_revert` and `_is_applied` for a patch that only swaps module-level functions and
    methods: each swap is (home module, attribute, make(original) -> replacement, module prefix to rebind in),
    each method (home module, class, method, make(original) -> replacement)."""
    def apply() -> None:
        for home, attr, make, prefix in swaps:
            swap_everywhere(home, attr, make, name, prefix)
        for home, cls, attr, make in methods:
            swap_method(home, cls, attr, make, name)

    def revert() -> None:
        for home, attr, _, prefix in swaps:
            restore_everywhere(home, attr, name, prefix)
        for home, cls, attr, _ in methods:
            restore_method(home, cls, attr, name)

    def is_applied() -> bool:
        return all(is_swapped(home, attr, name) for home, attr, _, _ in swaps) and \
            all(method_swapped(home, cls, attr, name) for home, cls, attr, _ in methods)

    return {"_apply": apply, "_revert": revert, "_is_applied": is_applied}
