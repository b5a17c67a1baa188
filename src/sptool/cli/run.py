"""``sptool run --recipe NAME``: a paper's whole self-play loop in one process, resumable."""

from __future__ import annotations

import time
from typing import List, Optional

import typer

from sptool.cli import common


def register(app: typer.Typer) -> None:
    app.command("run")(run)


class RunProgress:
    """Renders the driver's events on stderr: iteration, stage, items, ETA."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.status = None
        self.iteration = (0, 0)
        self.started = time.monotonic()
        self.iteration_started = self.started
        self.iteration_times: list[float] = []
        self.stage_started = self.started

    def eta(self) -> str:
        done, total = self.iteration
        if not self.iteration_times or not total:
            return ""
        mean = sum(self.iteration_times) / len(self.iteration_times)
        return f", ETA {mean * (total - done + 1) - (time.monotonic() - self.iteration_started):.0f}s"

    def __call__(self, event: dict) -> None:
        if self.quiet and event["event"] != "warning":  # warnings are shown even with --quiet
            return
        kind = event["event"]
        if kind == "iteration":
            if self.iteration[0]:
                self.iteration_times.append(time.monotonic() - self.iteration_started)
            self.iteration_started = time.monotonic()
            self.iteration = (event["iteration"], event["iterations"])
            if event.get("phase"):
                common.err_console.print(f"[bold]{event['phase']}[/bold]")
            else:
                common.err_console.print(f"[bold]iteration {event['iteration']}/{event['iterations']}[/bold]")
        elif kind == "stage":
            self.stage_started = time.monotonic()
            self._update(f"{event['stage']} ({event['index']}/{event['total']}): starting{self.eta()}")
        elif kind == "progress":
            rate = event["items"] / max(time.monotonic() - self.stage_started, 1e-9)
            self._update(f"{event['stage']}: {event['items']} items ({rate:.2f}/s){self.eta()}")
        elif kind == "stage-done":
            self._update(None)
            common.err_console.print(f"  {event['stage']}: {event['records']} records in "
                                     f"{event['wall_s']:.1f}s", markup=False)
            for name, values in ((event.get("metrics") or {}).get("benchmarks") or {}).items():
                shown = ", ".join(f"{key} {value:.3f}" for key, value in values.items() if value is not None)
                common.err_console.print(f"  held-out {name}: {shown}", markup=False)
        elif kind == "stage-replayed":
            common.err_console.print(f"  {event['stage']}: training again from the newest checkpoint "
                                     f"({', '.join(event['roles'])})", markup=False, style="dim")
        elif kind == "warning":
            self._update(None)
            common.err_console.print(f"warning: {event['message']}", markup=False, style="yellow")
            return
        elif kind == "stage-skipped":
            common.err_console.print(f"  {event['stage']}: done before ({event['records']} records, "
                                     f"read back)", markup=False, style="dim")

    def _update(self, text: Optional[str]) -> None:
        if not common.err_console.is_terminal:
            return
        if text is None:
            if self.status is not None:
                self.status.stop()
                self.status = None
            return
        if self.status is None:
            self.status = common.err_console.status(text)
            self.status.start()
        else:
            self.status.update(text)

    def close(self) -> None:
        self._update(None)


def run(
    recipe: str = typer.Option(..., "--recipe", "-r", envvar="SPTOOL_RECIPE",
                               help="wist, svs, rzero, rquest or rlvr (`sptool recipes list`)."),
    run_dir: Optional[str] = typer.Option(None, "--run-dir", help="Run directory (default runs/<recipe>-<timestamp>)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --run-dir from its last finished stage."),
    tiny: bool = typer.Option(False, "--tiny", help="The recipe's tiny preset: minutes on a laptop CPU."),
    config_file: Optional[str] = typer.Option(None, "--config", envvar="SPTOOL_CONFIG",
                                              help="TOML file overriding the recipe."),
    sets: List[str] = typer.Option([], "--set", help="Override one key, e.g. --set wist.paths=4 "
                                   "(repeatable; a bare key means the recipe's own or a shared one)."),
    iterations: Optional[int] = typer.Option(None, "--iterations", "-n", help="Shortcut for --set run.iterations=N."),
    data: Optional[str] = typer.Option(None, "--data", help="svs, rlvr: the labelled problem set (JSONL question, answer)."),
    model: Optional[str] = typer.Option(None, "-m", "--model", help="Starting policy (shortcut for --set model.policy=M)."),
    backend: Optional[str] = typer.Option(None, "--backend", help="Generation backend (model.backend): hf, scripted, vllm, openai."),
    base_url: Optional[str] = typer.Option(None, "--base-url", help="openai backend: server URL(s), comma-separated "
                                           "(model.base_url; `sptool serve` starts one)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Run seed (run.seed)."),
    keep: Optional[int] = typer.Option(None, "--keep", help="Checkpoints kept per role (run.keep; 0 = all)."),
    eval_files: List[str] = typer.Option([], "--eval", help="Held-out benchmark JSONL (question, answer), "
                                         "evaluated before the first and after the last iteration "
                                         "(eval.benchmarks; repeatable)."),
    eval_every: Optional[int] = typer.Option(None, "--eval-every", help="Also evaluate after every N-th "
                                             "iteration (eval.every)."),
    probe: Optional[str] = typer.Option(None, "--probe", help="Labelled probe JSONL (question, answer): each "
                                        "iteration reports the pseudo-label accuracy on it (health.probe)."),
    log_with: List[str] = typer.Option([], "--log-with", help="Also send per-iteration metrics and the report's "
                                       "plots to tensorboard, trackio and/or wandb (repeatable or "
                                       "comma-separated; metrics.jsonl stays the record)."),
    quiet: bool = common.QuietOpt,
) -> None:
    """Run a recipe's self-play loop: stages in one process, outputs and checkpoints in a run directory.

    Examples: sptool run --recipe rzero --tiny | sptool run --recipe svs --data problems.jsonl
    --set svs.problems=64 --eval held_out.jsonl --eval-every 5 | sptool run --recipe wist --run-dir runs/w1 --resume
    """
    from sptool.recipes import build_run, data_recipes, load_config
    from sptool.core.records import UsageError

    shortcuts = [(iterations, "run.iterations"), (data, f"{recipe}.data"), (model, "model.policy"),
                 (backend, "model.backend"), (base_url, "model.base_url"),
                 (seed, "run.seed"), (keep, "run.keep"),
                 (",".join(eval_files) or None, "eval.benchmarks"), (eval_every, "eval.every"),
                 (probe, "health.probe")]
    extra = []
    for value, key in shortcuts:
        if value is None:
            continue
        if key == f"{recipe}.data" and recipe not in data_recipes():
            raise UsageError(f"--data belongs to --recipe {' or '.join(data_recipes())}")
        extra.append(f"{key}={value}" if not isinstance(value, str) else f'{key}="{value}"')
    config = load_config(recipe, tiny=tiny, config_file=config_file, sets=[*extra, *sets])
    if run_dir is None:
        if resume:
            raise UsageError("--resume needs --run-dir DIR")
        run_dir = f"runs/{recipe}-{time.strftime('%Y%m%d-%H%M%S')}"
    import os

    from sptool.run.trackers import TrackerLog, parse_log_with

    rank0 = os.environ.get("RANK", "0") in ("", "0")
    if not rank0:
        quiet = True  # ranks > 0 of `accelerate launch`/`torchrun`: rank 0 reports and tracks
    trackers = TrackerLog(parse_log_with(log_with) if rank0 else [], run_dir, config)
    progress = RunProgress(quiet)
    log = None if quiet else (lambda message: common.err_console.print(f"  {message}", markup=False,
                                                                       style="dim", soft_wrap=True))
    def on_event(event: dict) -> None:
        progress(event)
        trackers(event)

    driver = build_run(config, run_dir, resume=resume, on_event=on_event, log=log)
    try:
        summary = driver.run()
    finally:
        progress.close()
        trackers.close()
    if not quiet:
        common.err_console.print(f"run {recipe}: {summary['iterations']} iterations, "
                                 f"{summary['stages_run']} stages run, {summary['stages_resumed']} "
                                 f"read back, {summary['wall_s']:.1f}s [{run_dir}]", markup=False)
