"""``sptool novelty``: R-Quest's sampled pairwise same-task gate, judged by a frozen model."""

from __future__ import annotations

from typing import Optional

import typer

from sptool.cli import common


def register(app: typer.Typer) -> None:
    app.command("novelty")(novelty)


@common.backend_options(model=typer.Option(
    "tiny", "-m", "--model", envvar="SPTOOL_JUDGE_MODEL",
    help="Frozen judge model (R-Quest: the base model): HF id, local directory, or 'tiny'."))
@common.prompt_options("novelty")
@common.stage_io()
def novelty(
    input_path: Optional[str] = common.InputArg,
    output: str = common.OutputOpt,
    partners: int = typer.Option(8, "--partners",
                                 help="Other candidates of the batch compared with each one (R-Quest: 8)."),
    candidates_per_batch: int = typer.Option(2048, "--candidates-per-batch",
                                             help="Candidates held at once; partners are drawn within "
                                                  "a batch (the whole input up to this cap)."),
    seed: int = common.SeedOpt,
    max_tokens: int = typer.Option(16, "--max-tokens", help="Maximum new tokens per judgement."),
    stage_io: common.StageIO = None,
    prompt_options: common.PromptOptions = None,
    backend_options: common.BackendOptions = None,
) -> None:
    """Mark each candidate question novel or not: sampled partners, greedy yes/no judge.

    Adds 'novelty': {novel, compared: [{id, verdict, raw}], judge, k}. Records with
    "valid": false pass through untouched. Cost: candidates x partners judgements.
    """
    from sptool.stages.novelty import NoveltyStage

    judge = backend_options.load(stage_io.quiet)
    stage = NoveltyStage(judge, k=partners, batch_size=candidates_per_batch, seed=seed,
                         max_new_tokens=max_tokens,
                         prompt=prompt_options.load("novelty"))
    stage_io.run(stage, input_path=input_path, output=output)
