"""Files shipped inside the package (``sptool/data/``), named ``package:NAME`` in settings and options.

The recipes' small default sets (the validity-initialisation sample, the tiny addition set, WIST's
fixture tree, titles and web corpus) ship as package data and are read through
:mod:`importlib.resources`, so a run works from any directory with the installed package alone.
A setting value ``package:validity_init.jsonl`` names the shipped file; any other value is the
user's own path and, when relative, resolves against the current directory, as the user meant.
"""

from __future__ import annotations

import atexit
import contextlib
from importlib import resources
from pathlib import Path

from sptool.core.records import InputError

PACKAGE_SCHEME = "package:"

_extracted = contextlib.ExitStack()  # files copied out of a zipped install, removed at exit
atexit.register(_extracted.close)


def is_packaged(spec: object) -> bool:
    """Whether ``spec`` names a shipped file (``package:NAME``)."""
    return str(spec).startswith(PACKAGE_SCHEME)


def packaged_names() -> list[str]:
    """The shipped files and folders, e.g. ``validity_init.jsonl``, ``web``."""
    root = resources.files("sptool").joinpath("data")
    if not root.is_dir():
        return []
    return sorted(entry.name for entry in root.iterdir() if not entry.name.startswith(("_", ".")))


def packaged_path(name: str) -> Path:
    """The shipped file or folder ``name`` as a path on disk; an unknown name is an
    :class:`InputError` listing the shipped ones."""
    name = name.strip().strip("/")
    target = resources.files("sptool").joinpath("data")
    for part in name.split("/"):
        target = target.joinpath(part)
    if not name or ".." in name.split("/") or not (target.is_file() or target.is_dir()):
        raise InputError("no such file shipped with sptool", source=PACKAGE_SCHEME + name,
                         hint="shipped: " + ", ".join(PACKAGE_SCHEME + n for n in packaged_names()))
    if isinstance(target, Path):  # an ordinary install: the file on disk itself
        return target
    return Path(_extracted.enter_context(resources.as_file(target)))


def local_path(spec: str) -> str:
    """``package:NAME`` → the shipped file's path on disk; any other spec unchanged."""
    spec = str(spec)
    if is_packaged(spec):
        return str(packaged_path(spec[len(PACKAGE_SCHEME):]))
    return spec
