"""Accuracy bands: is a value inside [lo, hi] (the band rules of R-Zero, R-Quest and SvS)."""

from __future__ import annotations


def in_band(value: float | None, band: tuple[float, float], inclusive: bool = True) -> bool:
    """value ∈ [lo, hi] (``inclusive``) or value ∈ (lo, hi); None is never in a band."""
    if value is None:
        return False
    lo, hi = band
    return lo <= value <= hi if inclusive else lo < value < hi
