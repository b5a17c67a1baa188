"""Moved to :mod:`sptool.run.config` (the shared sections belong to the executor); this name stays
an alias."""

import sys

from sptool.run import config as _config

sys.modules[__name__] = _config
