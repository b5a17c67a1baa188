"""``sptool eval``: greedy accuracy, mean@k and pass@k on benchmark files."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List, Optional

import typer

from sptool.cli import common


def register(app: typer.Typer) -> None:
    app.command("eval")(evaluate)


def benchmark_names(paths: List[str]) -> List[str]:
    """One name per benchmark source: its stem (a hub id), or its path where two share a stem."""
    from sptool.stages.problemsets.sources import source_name

    stems = [source_name(path) for path in paths]
    return [path if stems.count(stem) > 1 else stem for stem, path in zip(stems, paths)]


@common.prompt_options("solve")
@common.backend_options()
@common.sampling_options(per="sample")
def evaluate(
    benchmarks: List[str] = typer.Argument(..., help="Benchmark problem sets: JSONL (question, answer), "
                                           "parquet, JSON, CSV, a datasets directory (DIR[@SPLIT]) or "
                                           "hf:NAME[:CONFIG][@SPLIT]."),
    preset: Optional[str] = common.PresetOpt,
    question_field: Optional[str] = common.QuestionFieldOpt,
    answer_field: Optional[str] = common.AnswerFieldOpt,
    samples: int = typer.Option(8, "-k", "--samples", help="Samples per problem (n of pass@k)."),
    pass_at: str = typer.Option("1,8", "--pass-at", help="Comma-separated k values for pass@k (<= samples)."),
    sampling: common.SamplingParams = None,
    no_greedy: bool = typer.Option(False, "--no-greedy", help="Skip the greedy-accuracy pass."),
    workers: int = typer.Option(min(4, os.cpu_count() or 1), "--workers", envvar="SPTOOL_WORKERS",
                                help="Grading processes (as in verify)."),
    require_boxed: bool = common.RequireBoxedOpt,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (for scripts) instead of a table."),
    samples_out: Optional[str] = typer.Option(None, "--samples-out", help="Write graded samples (JSONL) here."),
    quiet: bool = common.QuietOpt,
    backend_options: common.BackendOptions = None,
    prompt_options: common.PromptOptions = None,
) -> None:
    """Evaluate a model: greedy accuracy, mean@k, and unbiased pass@k per benchmark."""
    from rich.table import Table

    from sptool.stages.evaluate import evaluate_benchmark, parse_ks
    from sptool.core.jsonl import AtomicJsonlWriter
    from sptool.stages.problemsets import read_problems
    from sptool.stages.problemsets.columns import Mapping
    from sptool.core.records import LABELLED

    common.check_outputs({"--samples-out": samples_out})
    mapping = Mapping(preset or "", question_field or "", answer_field or "").check()
    ks = parse_ks(pass_at)
    spec = prompt_options.load("solve")
    params = sampling
    records_by_name = {name: read_problems(path, LABELLED, mapping, need_answer=True,  # no answer: file:line
                                           allow_empty=True)
                       for name, path in zip(benchmark_names(benchmarks), benchmarks)}
    engine = backend_options.load(quiet)
    model = backend_options.model
    results, graded_all = [], []
    for name, records in records_by_name.items():
        with common.Progress(f"eval {name}", quiet, unit="benchmarks"):
            result, graded = evaluate_benchmark(name, records, engine, samples=samples, ks=ks,
                                                params=params, greedy=not no_greedy, workers=workers,
                                                require_boxed=require_boxed, prompt=spec)
        results.append(result)
        graded_all.extend({**r, "benchmark": name} for r in graded)
    if samples_out:
        with AtomicJsonlWriter(samples_out, option="--samples-out") as out:
            for record in graded_all:
                out.write(record)
    if as_json:
        typer.echo(json.dumps({"model": model, "samples": samples, "preset": None if mapping.plain else mapping.describe(),
                               "benchmarks": [r.as_dict() for r in results]}))
        return
    table = Table(title=f"sptool eval — model {model}, {samples} samples/problem")
    for column in ("benchmark", "problems", "preset", "greedy acc", "answered", f"mean@{samples}", *[f"pass@{k}" for k in ks]):
        table.add_column(column, justify="right" if column != "benchmark" else "left")
    for r in results:
        greedy = "-" if r.greedy_accuracy is None else f"{r.greedy_accuracy:.3f}"
        answered = "-" if r.greedy_answered is None else f"{r.greedy_answered:.3f}"
        table.add_row(r.name, str(r.problems), mapping.describe(), greedy, answered, f"{r.mean_at_k:.3f}",
                      *[f"{r.pass_at[k]:.3f}" if k in r.pass_at else "-" for k in ks])
    from rich.console import Console

    Console().print(table)
