"""``sptool verify``: grade sampled answers with math-verify, majority vote, INVALID counting."""

from __future__ import annotations

import os
from typing import Optional

import typer

from sptool.cli import common


def register(app: typer.Typer) -> None:
    app.command("verify")(verify)


@common.stage_io()
def verify(
    input_path: Optional[str] = common.InputArg,
    output: str = common.OutputOpt,
    workers: int = typer.Option(min(4, os.cpu_count() or 1), "--workers", envvar="SPTOOL_WORKERS",
                                help="Grading processes (0: inline, no deadline)."),
    deadline: float = typer.Option(30.0, "--deadline",
                                   help="Hard limit in seconds per question; overruns become verify_error."),
    pseudo_label: bool = typer.Option(False, "--pseudo-label",
                                      help="Ignore 'answer' and grade against the majority answer."),
    require_boxed: bool = common.RequireBoxedOpt,
    vote: str = typer.Option("always", "--vote",
                             help="The majority vote: always (every question), or auto (only where it is "
                                  "the label: --pseudo-label or no 'answer'; majority, majority_frac and "
                                  "n_classes are null beside a reference, and grading is much faster)."),
    stage_io: common.StageIO = None,
) -> None:
    """Grade solved questions: per-sample answer/correct, p_hat, var, majority, invalid_frac."""
    from sptool.core.records import UsageError
    from sptool.stages.verify import VOTES, VerifyStage

    if vote not in VOTES:
        raise UsageError(f"unknown --vote '{vote}'; choose from {', '.join(VOTES)}")

    stage = VerifyStage(workers=workers, deadline_s=deadline, pseudo_label=pseudo_label,
                        require_boxed=require_boxed, vote=vote)
    stage_io.run(stage, input_path=input_path, output=output)
