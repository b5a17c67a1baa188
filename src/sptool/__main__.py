"""``python -m sptool``: the same command as ``sptool``."""

from sptool.cli.main import main

main()
