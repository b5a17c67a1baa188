"""Moved to :mod:`sptool.faults` (a core module every layer may import); this name stays an alias."""

import sys

from sptool import faults as _faults

sys.modules[__name__] = _faults
