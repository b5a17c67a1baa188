"""Moved to :mod:`sptool.tree.plot`; this name stays an alias."""

import sys

from sptool.tree import plot as _plot

sys.modules[__name__] = _plot
