"""A value computed from a tensor, kept while that very tensor comes back unchanged (tic.harness.kernels)."""

from __future__ import annotations

import weakref
from typing import Callable

import torch


class TensorMemo:
    """build(tensor, *args) for the last tensor seen. Every layer of one forward (or backward) passes the same mask
    (or position) tensor object, and reading anything back from it syncs the device: the value is kept while that
    very object (held weakly), unmodified (tensor version) and of the same shape, comes back with equal args. An
    inference-mode tensor has no version counter, so nothing would show it changed in place: its value is built
    every time.
    """

    def __init__(self, build: Callable):
        self.build = build
        self._held = False
        self._ref = self._key = self._value = None

    def get(self, t: torch.Tensor | None, *args):
        if t is not None and t.is_inference():
            return self.build(t, *args)
        key = (None if t is None else (t._version, tuple(t.shape)), args)
        same_object = self._ref is None if t is None else self._ref is not None and self._ref() is t
        if not (self._held and self._key == key and same_object):
            self._value = self.build(t, *args)
            self._ref = None if t is None else weakref.ref(t)
            self._key, self._held = key, True
        return self._value
