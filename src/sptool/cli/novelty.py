"""``sptool novelty``: R-Quest's sampled pairwise same-task gate, judged by a frozen model."""

from __future__ import annotations

from typing import List, Optional

import typer

from sptool.cli import common


def register(app: typer.Typer) -> None:
    app.command("novelty")(novelty)


def novelty(
    input_path: Optional[str] = common.InputArg,
    output: str = common.OutputOpt,
    compare: int = typer.Option(8, "-k", "--compare",
                                help="Other candidates of the batch compared with each one (R-Quest: 8)."),
    batch_size: int = typer.Option(2048, "--batch-size",
                                   help="Candidates per batch (partners are drawn within a batch); "
                                        "the whole input up to this cap."),
    model: str = typer.Option("tiny", "-m", "--model", envvar="SPTOOL_JUDGE_MODEL",
                              help="Frozen judge model (R-Quest: the base model): HF id, local "
                                   "directory, or 'tiny'."),
    backend: str = common.BackendOpt,
    seed: int = common.SeedOpt,
    max_tokens: int = typer.Option(16, "--max-tokens", help="Maximum new tokens per judgement."),
    prompt: Optional[str] = common.prompt_opt("novelty"),
    prefix: Optional[str] = common.PrefixOpt,
    stop: Optional[List[str]] = common.StopOpt,
    no_chat_template: bool = common.NoChatTemplateOpt,
    gen_batch_size: int = common.GenBatchSizeOpt,
    device: Optional[str] = common.DeviceOpt,
    dtype: Optional[str] = common.DtypeOpt,
    quiet: bool = common.QuietOpt,
    skip_invalid: bool = common.SkipInvalidOpt,
    rejects: Optional[str] = common.RejectsOpt,
) -> None:
    """Mark each candidate question novel or not: K sampled partners, greedy yes/no judge.

    Adds 'novelty': {novel, compared: [{id, verdict, raw}], judge, k}. Records with
    "valid": false pass through untouched. Cost: batch size x K judgements.
    """
    from sptool.models.base import load_backend
    from sptool.novelty import NoveltyStage

    log = None if quiet else (lambda message: common.err_console.print(message, markup=False))
    judge = load_backend(backend, model, device=device, dtype=dtype, batch_size=gen_batch_size,
                         chat_template=not no_chat_template, log=log)
    stage = NoveltyStage(judge, k=compare, batch_size=batch_size, seed=seed,
                         max_new_tokens=max_tokens,
                         prompt=common.load_prompt_option("novelty", prompt, prefix, stop))
    common.run_stage(stage, input_path=input_path, output=output, quiet=quiet,
                     skip_invalid=skip_invalid, rejects=rejects)
