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
    stage_io: common.StageIO = None,
) -> None:
    """Grade solved questions: per-sample answer/correct, p_hat, var, majority, invalid_frac."""
    from sptool.stages.verify import VerifyStage

    stage = VerifyStage(workers=workers, deadline_s=deadline, pseudo_label=pseudo_label,
                        require_boxed=require_boxed)
    stage_io.run(stage, input_path=input_path, output=output)
