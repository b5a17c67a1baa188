"""``sptool challenge --from documents|nothing|solutions``: generate candidate questions."""

from __future__ import annotations

import dataclasses
from typing import Optional

import typer

from sptool.cli import common
from sptool.prompts import MAX_DOCUMENT_CHARS
from sptool.rewards import SVS_UNDERPERFORMING_BAND
from sptool.stages.challenge.gamma import MIN_QUESTION_CHARS


def register(app: typer.Typer) -> None:
    app.command("challenge")(challenge)


@common.prompt_options("challenger", "questioner", "synthesis")
@common.backend_options()
@common.sampling_options(per="generation")
@common.stage_io()
def challenge(
    input_path: Optional[str] = common.InputArg,
    source: str = typer.Option(..., "--from", help="documents (WIST: QA pairs from `corpus fetch` "
                               "documents), nothing (R-Zero/R-Quest questioner; input optional: "
                               "topic records), solutions (SvS: variants from `verify` output)."),
    output: str = common.OutputOpt,
    candidates: int = typer.Option(8, "--candidates",
                                   help="documents: G QA candidates per document; nothing: problems "
                                        "per seed; solutions: G_v variants per correct solution."),
    sampling: common.SamplingParams = None,
    prompts_per_call: int = typer.Option(4, "--prompts-per-call",
                                         help="documents, solutions: prompts per backend call "
                                              "(each with --candidates samples)."),
    group_size: int = typer.Option(4, "--group-size",
                                   help="nothing: problems per group_id (the questioner's GRPO group), "
                                        "sampled in one backend call."),
    band: str = typer.Option(",".join(str(x) for x in SVS_UNDERPERFORMING_BAND), "--band",
                             help="solutions: under-performing accuracy band LOW,HIGH "
                                  "(SvS: 12.5%-50%), inclusive."),
    strict_band: bool = typer.Option(False, "--strict-band", help="solutions: LOW < Acc < HIGH "
                                     "(SvS Algorithm 1) instead of the closed range (§3.3)."),
    max_solutions: int = typer.Option(8, "--max-solutions",
                                      help="solutions: correct solutions used per problem."),
    max_document_chars: int = typer.Option(MAX_DOCUMENT_CHARS, "--max-document-chars",
                                           help="documents: truncate longer documents in the prompt."),
    min_question_chars: int = typer.Option(MIN_QUESTION_CHARS, "--min-question-chars", min=1,
                                           help="documents: the validator Γ's shortest question, in "
                                                "characters ('What is 89 + 14?' has 16)."),
    logprobs: bool = common.LogprobsOpt,
    stage_io: common.StageIO = None,
    backend_options: common.BackendOptions = None,
    prompt_options: common.PromptOptions = None,
) -> None:
    """Generate candidate questions; every generation is emitted with valid/invalid_reason.

    Examples: sptool challenge --from documents docs.jsonl --candidates 8 |
    sptool challenge --from nothing --candidates 8 | sptool challenge --from solutions verified.jsonl
    """
    from sptool.stages.challenge import MODES, make_challenge_stage

    spec = prompt_options.load(MODES.get(source).role)
    options: dict = dict(candidates=candidates, prompt=spec,
                         batch_size=group_size if source == "nothing" else prompts_per_call,
                         params=dataclasses.replace(sampling, logprobs=logprobs))
    records = None
    if source == "solutions":
        from sptool.settings import parse_band

        options.update(band=parse_band(band, "--band"), strict_band=strict_band, max_solutions=max_solutions)
    elif source == "documents":
        options.update(max_document_chars=max_document_chars, min_question_chars=min_question_chars)
    elif source == "nothing":
        # No INPUT: generate from an empty seed without touching stdin. '-' or a file: topic seeds.
        options.update(unseeded=input_path is None)
        if input_path is None:
            records, input_path = iter(()), "<empty seed>"
    engine = backend_options.load(stage_io.quiet)
    stage = make_challenge_stage(source, engine, **options)
    stage_io.run(stage, input_path=input_path, output=output, records=records)
