"""One registry for every table of named things: backends, search engines, recipes, filters,
objectives, challenge modes.

The pattern is lm-evaluation-harness's (``lm_eval/api/registry.py``): an entry is either the
object itself or a lazy ``"module:attribute"`` string that is imported on first :meth:`get`, so
registering the ``hf`` backend does not import torch (``sptool --help`` stays fast). An unknown
name is a :class:`~sptool.core.records.UsageError` (exit 2) that suggests the closest name and lists
every choice in sorted order.
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any, Generic, Iterator, TypeVar, Union

from sptool.core.records import UsageError

T = TypeVar("T")


def closest(name: str, known, n: int = 1) -> list[str]:
    """The ``n`` known names closest to ``name`` (difflib's ratio ≥ 0.6): every did-you-mean
    hint in sptool comes from here."""
    return difflib.get_close_matches(name, list(known), n=n)


def unknown_name_error(kind: str, name: str, known, *, choices: str | None = None) -> UsageError:
    """``unknown <kind> '<name>'. Did you mean '<close>'? Choose from: a, b, c``: every unknown
    name in sptool is worded here. ``choices`` replaces ``Choose from: …`` where the list is long
    or comes with another way out (``… --list`` shows every task; or give a file path)."""
    close = closest(name, known)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return UsageError(f"unknown {kind} '{name}'.{hint} {choices or 'Choose from: ' + ', '.join(sorted(known))}")


class Registry(Generic[T]):
    """Named entries of one kind; ``kind`` names them in error messages (e.g. ``"backend"``)."""

    def __init__(self, kind: str, entries: dict[str, Union[T, str]] | None = None):
        self.kind = kind
        self._entries: dict[str, Union[T, str]] = {}
        for name, entry in (entries or {}).items():
            self.register(name, entry)

    def register(self, name: str, entry: Union[T, str, None] = None) -> Any:
        """Register ``entry`` (an object or a lazy ``"module:attribute"``) under ``name``.

        Without ``entry`` this is a decorator: ``@REG.register("name")``. Registering a name
        again replaces it (a plugin may override a built-in).
        """
        if entry is None:
            def decorator(obj: T) -> T:
                self._entries[name] = obj
                return obj

            return decorator
        if isinstance(entry, str) and entry.count(":") != 1:
            raise ValueError(f"lazy {self.kind} entry must be 'module:attribute', got {entry!r}")
        self._entries[name] = entry
        return entry

    def get(self, name: str) -> T:
        """The entry called ``name``, importing it on first use; UsageError when unknown."""
        if name not in self._entries:
            raise unknown_name_error(self.kind, name, self.names())
        entry = self._entries[name]
        if isinstance(entry, str):
            module_name, attribute = entry.split(":")
            entry = getattr(importlib.import_module(module_name), attribute)
            self._entries[name] = entry
        return entry  # type: ignore[return-value]

    __getitem__ = get

    def check(self, name: str) -> str:
        """``name`` itself when registered (nothing is imported); UsageError otherwise."""
        if name not in self._entries:
            raise unknown_name_error(self.kind, name, self.names())
        return name

    def target(self, name: str) -> Union[T, str]:
        """The entry as registered: the lazy ``"module:attribute"`` string or the object."""
        self.check(name)
        return self._entries[name]

    def names(self) -> list[str]:
        """Every registered name, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"


__all__ = ["Registry", "unknown_name_error"]
