"""``sptool export RUN_DIR --output DIR``: a run's checkpoint as a plain HF model directory with a model card."""

from __future__ import annotations

from typing import Optional

import typer

from sptool.cli import common


def register(app: typer.Typer) -> None:
    app.command("export")(export)


def export(
    run_dir: str = typer.Argument(..., help="A `sptool run` directory."),
    output: str = typer.Option(..., "-o", "--output", help="The new model directory (must not exist or be empty)."),
    role: Optional[str] = typer.Option(None, "--role", help="The role whose weights to export (default: policy, "
                                       "else solver, else the only one)."),
    step: Optional[int] = typer.Option(None, "--step", help="The checkpoint's train step (default: the newest)."),
    adapter: bool = typer.Option(False, "--adapter", help="LoRA runs: keep the peft adapter instead of merging it "
                                 "into the base model."),
    quiet: bool = common.QuietOpt,
) -> None:
    """Write a run's newest (or --step) checkpoint as a Hugging Face model directory (loadable with
    AutoModelForCausalLM.from_pretrained, lm-eval, vLLM) with a README.md model card: base model,
    recipe and settings, data sources and their sha256, the held-out curve, the sptool version and
    the `huggingface-cli upload` line (nothing is uploaded)."""
    from sptool.export import export_run

    log = None if quiet else (lambda message: common.err_console.print(message, markup=False))
    written = export_run(run_dir, output, role=role, step=step, merge=not adapter, log=log)
    if not quiet:
        common.err_console.print(f"export: {written['role']} step {written['step']} ({written['kind']}) -> "
                                 f"{written['output']} (model card: README.md)", markup=False)
