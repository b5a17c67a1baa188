"""``sptool data``: labelled problem sets made on this machine (no download)."""

from __future__ import annotations

from typing import List, Optional

import typer

from sptool.cli import common

data_app = typer.Typer(help="Labelled problem sets made locally (no download).", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(data_app, name="data")


@data_app.command("gym")
def gym(
    tasks: Optional[List[str]] = typer.Argument(None, help="reasoning-gym task names, e.g. basic_arithmetic "
                                                           "chain_sum simple_equations.", show_default=False),
    n: int = typer.Option(100, "-n", "--count", help="Problems per task."),
    seed: int = common.SeedOpt,
    params: Optional[List[str]] = typer.Option(None, "--param",
                                               help="Task option KEY=VALUE (JSON value), for every task, "
                                                    "e.g. --param max_digits=2; repeat."),
    output: str = common.OutputOpt,
    list_tasks: bool = typer.Option(False, "--list", help="List the tasks (math-verify-graded ones marked) and exit."),
    quiet: bool = common.QuietOpt,
) -> None:
    """Write labelled JSONL (question, answer, task, grader, metadata) from reasoning-gym's generators.

    The same arguments give the same file. Tasks with a numeric or expression answer are graded
    by math-verify ('grader': 'math-verify'); others by the task's own scorer ('reasoning-gym').
    """
    from sptool import gym as G
    from sptool.core.jsonl import AtomicJsonlWriter
    from sptool.core.records import UsageError

    if list_tasks:
        for name in G.available_tasks():
            typer.echo(f"{name}\t{'math-verify' if name in G.MATH_TASKS else 'reasoning-gym'}")
        return
    if not tasks:
        raise UsageError("name at least one task (see `sptool data gym --list`)")
    if n < 1:
        raise UsageError(f"-n must be at least 1, got {n}")
    config = G.parse_params(params or [])
    for task in tasks:  # every task and --param checked before anything is written
        G.check_task(task)
        G.make_dataset(task, size=1, seed=seed, config=config)
    common.check_outputs({"--output": output})
    with common.Progress("data gym", quiet) as progress, AtomicJsonlWriter(output) as out:
        for task in tasks:
            for record in G.generate(task, n=n, seed=seed, config=config):
                out.write(record)
                progress.advance()
    if not quiet:
        common.err_console.print(f"data gym: {n * len(tasks)} problems ({', '.join(tasks)}, seed {seed}) "
                                 f"in {progress.seconds:.1f}s", markup=False)
