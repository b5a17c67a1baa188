"""``sptool decontaminate``: drop records that overlap benchmark problems (n-grams and MinHash)."""

from __future__ import annotations

from typing import List, Optional

import typer

from sptool.cli import common


def register(app: typer.Typer) -> None:
    app.command("decontaminate")(decontaminate)


@common.stage_io()
def decontaminate(
    input_path: Optional[str] = common.InputArg,
    benchmarks: List[str] = typer.Option(..., "-b", "--benchmark",
                                         help="Benchmark problem set (JSONL with question, optional id; "
                                              "parquet, JSON, CSV, a datasets directory, hf:NAME[:CONFIG]"
                                              "[@SPLIT]); repeat for several."),
    preset: Optional[str] = common.PresetOpt,
    question_field: Optional[str] = common.QuestionFieldOpt,
    output: str = common.OutputOpt,
    ngram: int = typer.Option(13, "--ngram", help="Words in a shared run that marks a copy."),
    min_words: int = typer.Option(8, "--min-words",
                                  help="A problem shorter than --ngram counts when it appears whole, if it "
                                       "has at least this many words (shorter ones: exact copies only)."),
    minhash_threshold: float = typer.Option(0.7, "--minhash-threshold",
                                            help="MinHash Jaccard (over word pairs) at or above which a "
                                                 "record is a near-copy."),
    no_minhash: bool = typer.Option(False, "--no-minhash", help="Only the n-gram test."),
    mark_invalid: bool = typer.Option(False, "--mark-invalid",
                                      help="Keep contaminated questions, marked \"valid\": false with the "
                                           "reason (self-play: the questioner is penalised as for any "
                                           "invalid question); documents are still dropped."),
    stage_io: common.StageIO = None,
) -> None:
    """Drop records whose 'question' (or WIST document 'text') overlaps a benchmark problem.

    Text is compared as normalised words (case, whitespace and punctuation ignored). A dropped
    record goes to --rejects with 'contamination': benchmark, problem_id, method (ngram or
    minhash), the matched span and the similarity.
    """
    from sptool.stages.decontaminate import DecontaminateStage, load_index
    from sptool.stages.problemsets.columns import Mapping

    index = load_index(benchmarks, mapping=Mapping(preset or "", question_field or "").check(),
                       ngram=ngram, min_words=min_words,
                       threshold=None if no_minhash else minhash_threshold)
    stage = DecontaminateStage(index, mark_invalid=mark_invalid)
    stage_io.run(stage, input_path=input_path, output=output)
