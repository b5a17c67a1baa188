"""The ``sptool`` command: a thin typer app; each command group lives in its own module.

Errors raised by the library as :class:`~sptool.core.records.SptoolError` become one line on stderr
and the error's exit code (2 for bad input and usage, 1 for runtime failures), never a
traceback (``SPTOOL_TRACEBACK=1`` shows one for debugging). The conversion happens inside the
app (:class:`SptoolGroup`), so ``sptool``, ``python -m sptool`` and an in-process ``CliRunner``
all see the same exit codes.
"""

from __future__ import annotations

import os
import signal

import click
import typer
from typer.core import TyperGroup

from sptool import __version__
from sptool.cli import (challenge, corpus, data, decontaminate, doctor, eval, export, filter, novelty,
                        posterior, recipes, report, run, serve, solve, train, tree, verify)
from sptool.core.records import SptoolError


class SptoolGroup(TyperGroup):
    """The root command group: turns every :class:`SptoolError` into one line and its exit code."""

    def invoke(self, ctx):
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        try:
            return super().invoke(ctx)
        except SptoolError as error:
            if os.environ.get("SPTOOL_TRACEBACK"):
                raise
            message = getattr(error, "message", None) or str(error)
            typer.echo(f"sptool: error: {message}", err=True)
            raise typer.Exit(error.exit_code) from None
        except _USAGE_ERRORS as error:  # typer's own: `-k abc`, `--temperature 1,5`
            if isinstance(error, _NO_ARGS_IS_HELP) or os.environ.get("SPTOOL_TRACEBACK"):
                raise
            typer.echo(f"sptool: error: {_one_line(error.format_message())}", err=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            typer.echo("sptool: interrupted", err=True)
            raise typer.Exit(130) from None
        except Terminated:
            typer.echo("sptool: terminated (SIGTERM); no output was committed", err=True)
            raise typer.Exit(143) from None
        except OSError as error:  # the environment: full disk, permissions, a vanished directory
            if os.environ.get("SPTOOL_TRACEBACK"):
                raise
            typer.echo(f"sptool: error: {describe_os_error(error)}", err=True)
            raise typer.Exit(1) from None


def _click_exceptions() -> list:
    """click's exception module and typer's vendored copy (typer >= 0.2x ships its own click)."""
    modules = [click.exceptions]
    try:
        from typer._click import exceptions as vendored
    except ImportError:  # an older typer: plain click
        vendored = None
    if vendored is not None and vendored is not click.exceptions:
        modules.append(vendored)
    return modules


_USAGE_ERRORS = tuple(m.UsageError for m in _click_exceptions())
_NO_ARGS_IS_HELP = tuple(m.NoArgsIsHelpError for m in _click_exceptions() if hasattr(m, "NoArgsIsHelpError"))


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


class Terminated(BaseException):
    """Raised in the main thread on SIGTERM, so that every ``with`` block unwinds: temporary
    output files are removed, worker pools are closed, nothing half-written is committed."""


def _terminate(signum, frame) -> None:
    raise Terminated()


def describe_os_error(error: OSError) -> str:
    """One line for an environment failure: the file and what went wrong."""
    import errno

    reason = error.strerror or str(error) or type(error).__name__
    where = error.filename if error.filename not in (None, "") else None
    hints = {errno.ENOSPC: " (the disk is full: free space and run again; nothing was committed)",
             errno.EDQUOT: " (disk quota exceeded; nothing was committed)",
             errno.EROFS: " (read-only file system)",
             errno.EACCES: " (permission denied: check the file and its directory)"}
    text = f"{where}: {reason}" if where else reason
    return text + hints.get(error.errno, "")


app = typer.Typer(
    name="sptool",
    cls=SptoolGroup,
    help="Self-play RL with verifiable rewards, as small JSONL stages.\n\n"
         "Records go to stdout, progress and summaries to stderr. "
         "Example: sptool solve questions.jsonl -k 4 | sptool verify",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# One module per command group (sptool/cli/<name>.py), each with register(app). They import
# nothing heavy themselves: torch & co. load inside the commands.
COMMAND_MODULES = (solve, verify, challenge, novelty, filter, tree, posterior, corpus, train, run,
                   recipes, report, export, eval, decontaminate, data, serve, doctor)
for _module in COMMAND_MODULES:
    _module.register(app)


def _check_options_first(typer_app: typer.Typer) -> None:
    """Every command checks its numeric options (finite, in range) before doing any work."""
    from sptool.settings.limits import checked

    for info in typer_app.registered_commands:
        if info.callback is not None:
            info.callback = checked(info.callback)
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            _check_options_first(group.typer_instance)


_check_options_first(app)


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
    signal.signal(signal.SIGTERM, _terminate)
    app(prog_name="sptool")


if __name__ == "__main__":
    main()
