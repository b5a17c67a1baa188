"""``sptool solve``: K sampled solutions per question."""

from __future__ import annotations

import dataclasses
from typing import Optional

import typer

from sptool.cli import common


def register(app: typer.Typer) -> None:
    app.command("solve")(solve)


@common.prompt_options("solve", "validity")
@common.backend_options()
@common.sampling_options(per="sample")
@common.stage_io()
def solve(
    input_path: Optional[str] = common.InputArg,
    output: str = common.OutputOpt,
    samples: int = typer.Option(8, "-k", "--samples", help="Solutions sampled per question."),
    mode: str = typer.Option("math", "--mode", help="math (answer in \\boxed{}) or validity "
                             "(may answer \\boxed{INVALID} for a flawed problem; R-Quest)."),
    sampling: common.SamplingParams = None,
    questions_per_call: int = typer.Option(16, "--questions-per-call",
                                           help="Questions per backend call (each with K samples)."),
    logprobs: bool = common.LogprobsOpt,
    deadline: Optional[float] = typer.Option(
        None, "--deadline", help="Total seconds for the whole command (model loading included); "
        "questions not solved by then are dropped (reason 'deadline', see --rejects), the solved "
        "ones are written, and the exit code is 1."),
    stage_io: common.StageIO = None,
    backend_options: common.BackendOptions = None,
    prompt_options: common.PromptOptions = None,
) -> None:
    """Sample K solutions per question (records need 'question'; 'answer' optional)."""
    import time

    from sptool.core.records import RuntimeFailure
    from sptool.stages.solve import MODES, SolveStage

    deadline_at = None if deadline is None else time.monotonic() + deadline

    if mode not in MODES:
        from sptool.core.records import UsageError

        raise UsageError(f"unknown --mode '{mode}'; choose from {', '.join(MODES)}")
    spec = prompt_options.load(MODES[mode])
    params = dataclasses.replace(sampling, logprobs=logprobs)
    engine = backend_options.load(stage_io.quiet)
    stage = SolveStage(engine, samples=samples, mode=mode, params=params, prompt=spec,
                       batch_size=questions_per_call, deadline=deadline_at)
    stage_io.run(stage, input_path=input_path, output=output)
    if stage.deadline_reached:
        dropped = stage.stats.dropped["deadline"]
        raise RuntimeFailure(f"solve: --deadline {deadline:g}s reached; {stage.stats.written} questions "
                             f"written, {dropped} not solved (dropped with reason 'deadline'"
                             f"{', in --rejects' if stage_io.rejects else ''})")
