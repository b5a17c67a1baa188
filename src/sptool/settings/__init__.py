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
            choices: Iterable[str] | Callable[[], Iterable[str]] | None = None,
            band: bool = False, validate: Callable[[Any], str | None] | None = None) -> Any:
    """A dataclass field with ``default`` and its description and checks in ``metadata``:
    ``minimum``/``maximum`` (inclusive), ``above``/``below`` (exclusive), ``choices`` (strings,
    or a function returning them, e.g. a registry's names: checked with did-you-mean),
    ``band`` (a pair 0 ≤ LOW ≤ HIGH ≤ 1), ``validate`` (a function: the value -> an error text or None)."""
    metadata = {"help": help, "source": source, "minimum": minimum, "above": above,
                "maximum": maximum, "below": below,
                "choices": choices if callable(choices) else (tuple(choices) if choices else None),
                "band": band, "validate": validate}
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


#: A number setting without a declared upper bound (and no :data:`sptool.settings.limits.LIMITS`
#: entry of the same name) is capped here, so that no setting can make a run endless.
MAX_COUNT = 10_000_000
MAX_MAGNITUDE = 1e6


def _interval(low: Any, low_open: bool, high: Any, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{format_value(low)}, {format_value(high)}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {format_value(low)}"
    return f"{'<' if high_open else '<='} {format_value(high)}"


def bounds(field: dataclasses.Field) -> tuple[Any, bool, Any, bool]:
    """``(low, low_open, high, high_open)`` of a number setting: its declared bounds, else the
    :data:`~sptool.settings.limits.LIMITS` entry of the same name (one name, one meaning), and an upper
    bound always (:data:`MAX_COUNT` for integers, :data:`MAX_MAGNITUDE` for numbers)."""
    m = field.metadata
    low, low_open = (m["above"], True) if m.get("above") is not None else (m.get("minimum"), False)
    high, high_open = (m["below"], True) if m.get("below") is not None else (m.get("maximum"), False)
    from sptool.settings.limits import LIMITS

    known = LIMITS.get(field.name) or LIMITS.get(field.name.removesuffix("_s"))
    if known is not None:
        if low is None and known.low is not None:
            low, low_open = known.low, known.low_open
        if high is None and known.high is not None:
            high, high_open = known.high, known.high_open
    if high is None:
        high, high_open = (MAX_COUNT if isinstance(field.default, int) else MAX_MAGNITUDE), False
        if low is None:
            low, low_open = -high, False
    return low, low_open, high, high_open


def choices_of(field: dataclasses.Field) -> tuple[str, ...] | None:
    choices = field.metadata.get("choices")
    return tuple(choices()) if callable(choices) else choices


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
    if m.get("validate") is not None:
        return m["validate"](value)
    choices = choices_of(field)
    if choices:
        if value in choices:
            return None
        from sptool.core.registry import unknown_name_error

        shown = [c if c else '""' for c in choices]
        return str(unknown_name_error("value", str(value), shown))
    if isinstance(value, bool) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return None
    low, low_open, high, high_open = bounds(field)
    for v in values:
        too_low = low is not None and (v <= low if low_open else v < low)
        too_high = high is not None and (v >= high if high_open else v > high)
        if too_low or too_high:
            return f"must be {_interval(low, low_open, high, high_open)}, got {format_value(value)}"
    return None


def check_ranges(obj: Any, label: Callable[[str], str]) -> None:
    """Raise a :class:`~sptool.core.records.UsageError` ``"{label(name)} must be …, got …"`` for the
    first field of ``obj`` outside its declared range."""
    from sptool.core.records import UsageError

    for field in dataclasses.fields(obj):
        problem = range_error(field, getattr(obj, field.name))
        if problem:
            raise UsageError(f"{label(field.name)} {problem}")


def parse_band(text: str, option: str) -> tuple[float, float]:
    """``"0.3,0.8"`` -> (0.3, 0.8), with a usage error naming the option otherwise."""
    from sptool.core.records import UsageError

    try:
        low, high = (float(part) for part in text.split(","))
    except ValueError:
        raise UsageError(f"{option} must be LOW,HIGH (e.g. 0.3,0.8), got '{text}'") from None
    return low, high
