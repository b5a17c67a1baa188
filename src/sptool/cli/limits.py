"""Moved to :mod:`sptool.limits` (the settings layer); this name stays an alias."""

import sys

from sptool import limits as _limits

sys.modules[__name__] = _limits
