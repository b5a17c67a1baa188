"""``sptool report RUN_DIR``: plots and a short text summary of a finished (or running) run."""

from __future__ import annotations

from typing import Optional

import typer

from sptool.cli import common


def register(app: typer.Typer) -> None:
    app.command("report")(report)


def report(
    run_dir: str = typer.Argument(..., help="A `sptool run` directory."),
    output: Optional[str] = typer.Option(None, "-o", "--output", help="Folder for the PNGs (default RUN_DIR/report)."),
    no_plots: bool = typer.Option(False, "--no-plots", help="Only the text summary."),
    quiet: bool = common.QuietOpt,
) -> None:
    """Write PNG plots (rewards, accuracy, validity/novelty, diversity, WIST tree posteriors), a
    page of example generated questions (questions.md: kept and rejected, with the reason) and
    print a text summary on stdout."""
    from sptool.run.report import guard_metrics, summary_text, write_plots, write_question_page

    text = guard_metrics(run_dir, lambda: summary_text(run_dir))
    if not no_plots:
        page = guard_metrics(run_dir, lambda: write_question_page(run_dir, output))
        for path in [*guard_metrics(run_dir, lambda: write_plots(run_dir, output)), *([page] if page else [])]:
            if not quiet:
                common.err_console.print(f"report: wrote {path}", markup=False)
    typer.echo(text)
