"""sptool: self-play RL with verifiable rewards as small, composable JSONL stages.

The layout (docs/architecture.md): ``core`` (records, JSONL, the stage contract, registries),
``net`` (outbound HTTP), ``models`` and ``prompts``, ``stages`` (one per command), ``settings``,
``filter`` and ``train``, the executor ``run``, the papers' ``recipes`` and the ``cli``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__version__ = "0.1.0"

#: Modules that moved in 0.1.0's re-layout (CHANGELOG): the old name still imports, as the same
#: module object, with a DeprecationWarning. (``sptool.net`` is now the package; it re-exports
#: the HTTP client's names that the module had.)
MOVED = {
    "records": "core.records", "jsonl": "core.jsonl", "fsguard": "core.fsguard", "stage": "core.stage",
    "registry": "core.registry", "faults": "core.faults", "workers": "core.workers",
    "verify": "stages.verify", "solve": "stages.solve", "novelty": "stages.novelty",
    "decontaminate": "stages.decontaminate", "evaluate": "stages.evaluate",
    "problemsets": "stages.problemsets", "challenge": "stages.challenge", "tree": "stages.tree",
    "corpus": "stages.corpus", "titles": "stages.tree.title_sources", "tree_plot": "stages.tree.plot",
    "limits": "settings.limits", "report": "run.report", "cli.limits": "settings.limits", "run.faults": "core.faults",
}


_LONGEST_FIRST = sorted(MOVED, key=len, reverse=True)


def moved_name(fullname: str) -> str | None:
    """The new name of ``sptool.<old>[.<rest>]``, or None when it did not move."""
    if not fullname.startswith("sptool."):
        return None
    name = fullname[len("sptool."):]
    for old in _LONGEST_FIRST:
        if name == old or name.startswith(old + "."):
            return "sptool." + MOVED[old] + name[len(old):]
    return None


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import sptool.<old name>`` gives the module at its new name (the same object)."""

    def find_spec(self, fullname, path=None, target=None):
        new = moved_name(fullname)
        if new is None or new == fullname:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = moved_name(spec.name)
        warnings.warn(f"{spec.name} moved to {new}", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        self.own_spec = getattr(self, "own_spec", {})
        self.own_spec[spec.name] = module.__spec__
        return module

    def exec_module(self, module):
        # the import system stamped the old name's spec on the module: give it back its own
        for old, spec in list(getattr(self, "own_spec", {}).items()):
            if spec.name == module.__name__:
                module.__spec__ = spec
                del self.own_spec[old]


# first on the path: otherwise ``sptool.challenge.parsing`` would be found again under its old
# name inside the moved package and loaded twice
if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())
