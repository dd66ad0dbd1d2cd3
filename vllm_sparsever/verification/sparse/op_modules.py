"""Modules that a custom torch op reaches by a string key (ops cannot take modules as arguments).

Weak and per instance: a layer leaves the registry with its model (an engine shut down inside a
long-lived process leaks nothing), and two engines in one process never share a key even when
their layers have the same prefix.
"""

from __future__ import annotations

import weakref
from typing import Generic, TypeVar

M = TypeVar("M")


class OpModuleRegistry(Generic[M]):
    def __init__(self) -> None:
        self._modules: weakref.WeakValueDictionary[str, M] = weakref.WeakValueDictionary()

    def add(self, name: str, module: M) -> str:
        """Register `module`; returns the key the op is called with."""
        key = f"{name}#{id(module):x}"
        self._modules[key] = module
        return key

    def __getitem__(self, key: str) -> M:
        return self._modules[key]

    def __len__(self) -> int:
        return len(self._modules)
