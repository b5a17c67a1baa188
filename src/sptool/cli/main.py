"""The ``sptool`` command: a thin typer app; each command group lives in its own module.

Errors raised by the library as :class:`~sptool.records.SptoolError` become one line on stderr
and the error's exit code (2 for bad input and usage, 1 for runtime failures), never a
traceback (``SPTOOL_TRACEBACK=1`` shows one for debugging).
"""

from __future__ import annotations

import os
import signal
import sys

import typer

from sptool import __version__
import importlib

from sptool.records import SptoolError

app = typer.Typer(
    name="sptool",
    help="Self-play RL with verifiable rewards, as small JSONL stages.\n\n"
         "Records go to stdout, progress and summaries to stderr. "
         "Example: sptool solve fixtures/questions.jsonl -k 4 | sptool verify",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# One module per command group (sptool/cli/<name>.py), each with register(app). Modules are
# imported at start-up but import nothing heavy themselves (torch & co. load inside commands).
COMMAND_MODULES = ("solve", "verify", "challenge", "novelty", "filter", "tree", "posterior",
                   "corpus", "train", "run", "recipes", "report", "eval")

for _name in COMMAND_MODULES:
    try:
        _module = importlib.import_module(f"sptool.cli.{_name}")
    except ModuleNotFoundError as _error:  # a command group not built yet in this checkout
        if _error.name != f"sptool.cli.{_name}":
            raise
        continue
    _module.register(app)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"sptool {__version__}")
        raise typer.Exit()


@app.callback()
def root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                      help="Print the version and exit.")) -> None:
    """Self-play RL with verifiable rewards, as small JSONL stages."""


def main() -> None:
    # Unix pipe hygiene: `sptool … | head` ends quietly instead of a BrokenPipeError traceback.
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        app()
    except SptoolError as error:
        if os.environ.get("SPTOOL_TRACEBACK"):
            raise
        message = getattr(error, "message", None) or str(error)
        print(f"sptool: error: {message}", file=sys.stderr)
        sys.exit(error.exit_code)
    except KeyboardInterrupt:
        print("sptool: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
