"""Typed settings: one dataclass field per value, carrying its help text, the paper section it
comes from and its range, so the recipe schema, ``recipes show``, the CLI help and the checks
all read the same declaration.

::

    @dataclass
    class WistOptions:
        sigma: float = setting(R.WIST_SIGMA, "width σ of the Gaussian variance reward",
                               "WIST Eq. 14, App. D", above=0)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable


def setting(default: Any, help: str, source: str = "", *, minimum: float | None = None,
            above: float | None = None, maximum: float | None = None, below: float | None = None,
            choices: Iterable[str] | None = None, band: bool = False) -> Any:
    """A dataclass field with ``default`` and its description and checks in ``metadata``:
    ``minimum``/``maximum`` (inclusive), ``above``/``below`` (exclusive), ``choices`` (strings),
    ``band`` (a pair 0 ≤ LOW ≤ HIGH ≤ 1)."""
    metadata = {"help": help, "source": source, "minimum": minimum, "above": above,
                "maximum": maximum, "below": below, "choices": tuple(choices) if choices else None,
                "band": band}
    return dataclasses.field(default=default, metadata=metadata)


def help_text(cls: type, name: str, *, default: bool = True) -> str:
    """``help (source; default D)`` of one field, for CLI help and ``recipes show --explain``."""
    field = {f.name: f for f in dataclasses.fields(cls)}[name]
    parts = [p for p in (field.metadata.get("source"),
                         f"default {format_value(field.default)}" if default else "") if p]
    return field.metadata.get("help", "") + (f" ({'; '.join(parts)})" if parts else "")


def format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(format_value(v) for v in value)
    if value == "":
        return '""'
    return str(value)


def range_error(field: dataclasses.Field, value: Any) -> str | None:
    """What is wrong with ``value`` for ``field`` (None when it is fine)."""
    m = field.metadata
    import math

    values = value if isinstance(value, (list, tuple)) else [value]
    if any(isinstance(v, float) and not math.isfinite(v) for v in values):
        return f"must be a finite number, got {format_value(value)}"
    if m.get("band"):
        low, high = value
        if not 0 <= low <= high <= 1:
            return f"must be LOW,HIGH with 0 <= LOW <= HIGH <= 1, got {format_value(tuple(value))}"
        return None
    if m.get("choices") and value not in m["choices"]:
        return f"must be one of {', '.join(m['choices'])}, got '{value}'"
    low, high = m.get("minimum"), m.get("maximum")
    above, below = m.get("above"), m.get("below")
    if low is not None and high is not None and not low <= value <= high:
        return f"must be in [{format_value(low)}, {format_value(high)}], got {value}"
    if low is not None and below is not None and not low <= value < below:
        return f"must be in [{format_value(low)}, {format_value(below)}), got {value}"
    if low is not None and high is None and below is None and value < low:
        return f"must be >= {format_value(low)}, got {value}"
    if above is not None and value <= above:
        return f"must be > {format_value(above)}, got {value}"
    return None


def check_ranges(obj: Any, label: Callable[[str], str]) -> None:
    """Raise a :class:`~sptool.records.UsageError` ``"{label(name)} must be …, got …"`` for the
    first field of ``obj`` outside its declared range."""
    from sptool.records import UsageError

    for field in dataclasses.fields(obj):
        problem = range_error(field, getattr(obj, field.name))
        if problem:
            raise UsageError(f"{label(field.name)} {problem}")


def parse_band(text: str, option: str) -> tuple[float, float]:
    """``"0.3,0.8"`` -> (0.3, 0.8), with a usage error naming the option otherwise."""
    from sptool.records import UsageError

    try:
        low, high = (float(part) for part in text.split(","))
    except ValueError:
        raise UsageError(f"{option} must be LOW,HIGH (e.g. 0.3,0.8), got '{text}'") from None
    return low, high
