"""Packaged prompt templates (text files with ``{field}`` placeholders), overridable with --prompt FILE.

A template is the user message. Placeholders are record fields (``{question}``, ``{answer}``, …);
they are substituted literally (no ``str.format``), so LaTeX braces such as ``\\boxed{}`` need no
escaping.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

from sptool.records import InputError, UsageError

_PLACEHOLDER = re.compile(r"\{([a-z_][a-z0-9_]*)\}")


def load_template(name_or_path: str) -> str:
    """A packaged template by name (``solve_math``) or a template file path."""
    path = Path(name_or_path)
    if path.suffix == ".txt" or path.exists():
        if not path.is_file():
            raise UsageError(f"prompt file {name_or_path} does not exist")
        return path.read_text(encoding="utf-8")
    try:
        return resources.files(__package__).joinpath(f"{name_or_path}.txt").read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"no packaged prompt '{name_or_path}'") from None


def fill_template(template: str, record: dict, **extra) -> str:
    """Substitute ``{field}`` placeholders from ``extra`` then ``record``; unknown names stay."""

    def substitute(match: re.Match) -> str:
        key = match.group(1)
        if key in extra:
            return str(extra[key])
        if key in record:
            value = record[key]
            if value is None:
                raise InputError(f"is null but the prompt template needs it", field=key)
            return str(value)
        return match.group(0)

    return _PLACEHOLDER.sub(substitute, template)


def template_fields(template: str) -> set[str]:
    return set(_PLACEHOLDER.findall(template))
