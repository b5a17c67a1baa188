"""``sptool solve``: K sampled solutions per question."""

from __future__ import annotations

from typing import Optional

import typer

from sptool.cli import common


def register(app: typer.Typer) -> None:
    app.command("solve")(solve)


@common.prompt_options("solve", "validity")
@common.backend_options()
def solve(
    input_path: Optional[str] = common.InputArg,
    output: str = common.OutputOpt,
    samples: int = typer.Option(8, "-k", "--samples", help="Solutions sampled per question."),
    mode: str = typer.Option("math", "--mode", help="math (answer in \\boxed{}) or validity "
                             "(may answer \\boxed{INVALID} for a flawed problem; R-Quest)."),
    temperature: float = common.TemperatureOpt,
    top_p: float = common.TopPOpt,
    max_tokens: int = typer.Option(512, "--max-tokens", help="Maximum new tokens per sample."),
    seed: int = common.SeedOpt,
    questions_per_call: int = typer.Option(16, "--questions-per-call",
                                           help="Questions per backend call (each with K samples)."),
    logprobs: bool = common.LogprobsOpt,
    deadline: Optional[float] = typer.Option(
        None, "--deadline", help="Total seconds for the whole command (model loading included); "
        "questions not solved by then are dropped (reason 'deadline', see --rejects), the solved "
        "ones are written, and the exit code is 1."),
    quiet: bool = common.QuietOpt,
    skip_invalid: bool = common.SkipInvalidOpt,
    rejects: Optional[str] = common.RejectsOpt,
    backend_options: common.BackendOptions = None,
    prompt_options: common.PromptOptions = None,
) -> None:
    """Sample K solutions per question (records need 'question'; 'answer' optional)."""
    import time

    from sptool.models.base import SamplingParams
    from sptool.core.records import RuntimeFailure
    from sptool.stages.solve import MODES, SolveStage

    deadline_at = None if deadline is None else time.monotonic() + deadline

    if mode not in MODES:
        from sptool.core.records import UsageError

        raise UsageError(f"unknown --mode '{mode}'; choose from {', '.join(MODES)}")
    spec = prompt_options.load(MODES[mode])
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_tokens,
                            seed=seed, logprobs=logprobs)
    engine = backend_options.load(quiet)
    stage = SolveStage(engine, samples=samples, mode=mode, params=params, prompt=spec,
                       batch_size=questions_per_call, deadline=deadline_at)
    common.run_stage(stage, input_path=input_path, output=output, quiet=quiet,
                     skip_invalid=skip_invalid, rejects=rejects)
    if stage.deadline_reached:
        dropped = stage.stats.dropped["deadline"]
        raise RuntimeFailure(f"solve: --deadline {deadline:g}s reached; {stage.stats.written} questions "
                             f"written, {dropped} not solved (dropped with reason 'deadline'"
                             f"{', in --rejects' if rejects else ''})")
