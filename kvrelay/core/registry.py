"""A named registry per plug-in point. Entries may be lazy ("module:attr") so that an
optional backend is imported only when it is chosen."""
from __future__ import annotations

import importlib
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T | str] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            self._entries[name] = obj
            return obj

        return deco

    def register_lazy(self, name: str, target: str) -> None:
        """`target` is "package.module:attr", imported on first `get(name)`."""
        self._entries[name] = target

    def names(self) -> list[str]:
        return sorted(self._entries)

    def get(self, name: str) -> T:
        if name not in self._entries:
            raise KeyError(f"unknown {self.kind} {name!r}; choose one of: {', '.join(self.names())}")
        entry = self._entries[name]
        if isinstance(entry, str):
            module, _, attr = entry.partition(":")
            entry = getattr(importlib.import_module(module), attr)
            self._entries[name] = entry
        return entry  # type: ignore[return-value]
