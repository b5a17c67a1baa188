"""``sptool solve``: K sampled solutions per question."""

from __future__ import annotations

from typing import List, Optional

import typer

from sptool.cli import common


def register(app: typer.Typer) -> None:
    app.command("solve")(solve)


def solve(
    input_path: Optional[str] = common.InputArg,
    output: str = common.OutputOpt,
    samples: int = typer.Option(8, "-k", "--samples", help="Solutions sampled per question."),
    mode: str = typer.Option("math", "--mode", help="math (answer in \\boxed{}) or validity "
                             "(may answer \\boxed{INVALID} for a flawed problem; R-Quest)."),
    model: str = common.ModelOpt,
    backend: str = common.BackendOpt,
    temperature: float = common.TemperatureOpt,
    top_p: float = common.TopPOpt,
    max_tokens: int = typer.Option(512, "--max-tokens", help="Maximum new tokens per sample."),
    seed: int = common.SeedOpt,
    prompt: Optional[str] = common.prompt_opt("solve", "validity"),
    prefix: Optional[str] = common.PrefixOpt,
    stop: Optional[List[str]] = common.StopOpt,
    no_chat_template: bool = common.NoChatTemplateOpt,
    batch_size: int = typer.Option(16, "--batch-size", help="Questions per backend call."),
    gen_batch_size: int = common.GenBatchSizeOpt,
    device: Optional[str] = common.DeviceOpt,
    dtype: Optional[str] = common.DtypeOpt,
    logprobs: bool = common.LogprobsOpt,
    base_url: Optional[str] = typer.Option(None, "--base-url", envvar="SPTOOL_BASE_URL",
                                           help="OpenAI-compatible server(s) for --backend openai, "
                                                "comma-separated (round-robin)."),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size",
                                             help="GPUs per model for --backend vllm."),
    quiet: bool = common.QuietOpt,
    skip_invalid: bool = common.SkipInvalidOpt,
    rejects: Optional[str] = common.RejectsOpt,
) -> None:
    """Sample K solutions per question (records need 'question'; 'answer' optional)."""
    from sptool.models.base import SamplingParams, load_backend
    from sptool.solve import MODES, SolveStage

    if mode not in MODES:
        from sptool.records import UsageError

        raise UsageError(f"unknown --mode '{mode}'; choose from {', '.join(MODES)}")
    spec = common.load_prompt_option(MODES[mode], prompt, prefix, stop)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_tokens,
                            seed=seed, logprobs=logprobs)
    log = None if quiet else (lambda message: common.err_console.print(message, markup=False))
    engine = load_backend(backend, model, device=device, dtype=dtype, batch_size=gen_batch_size,
                          chat_template=not no_chat_template, log=log, base_url=base_url,
                          tensor_parallel_size=tensor_parallel_size)
    stage = SolveStage(engine, samples=samples, mode=mode, params=params, prompt=spec,
                       batch_size=batch_size)
    common.run_stage(stage, input_path=input_path, output=output, quiet=quiet,
                     skip_invalid=skip_invalid, rejects=rejects)
