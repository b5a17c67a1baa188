"""``sptool serve``: vLLM's OpenAI-compatible server with live weight updates enabled."""

from __future__ import annotations

from typing import Optional

import typer

from sptool.cli import common


def register(app: typer.Typer) -> None:
    app.command("serve", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(serve)


def serve(
    ctx: typer.Context,
    model: str = typer.Argument("tiny", help="HF id, local HF directory, or 'tiny'."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (the weight-update endpoints "
                             "are open to whoever reaches it: keep it private)."),
    port: int = typer.Option(8000, "--port", help="Port."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name",
                                                    help="Name clients pass as -m (default: MODEL as given)."),
    lora_rank: int = typer.Option(0, "--lora-rank", help="Allow LoRA adapters up to this rank "
                                  "(runs with train.lora_r > 0); 0: full weights only."),
    dtype: Optional[str] = common.DtypeOpt,
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help="Longest prompt + completion."),
    gpu_memory_utilization: Optional[float] = typer.Option(
        None, "--gpu-memory-utilization", help="Share of GPU memory (on CPU: of RAM for the KV cache; default 0.3)."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu: the CPU defaults even with a GPU."),
    print_command: bool = typer.Option(False, "--print-command", help="Print the vLLM command and exit."),
) -> None:
    """Serve MODEL for `--backend openai` runs: vLLM's server with its weight-update endpoints on.

    After each training update a run reloads the new weights into every --base-url server (full
    weights in place; LoRA adapters loaded at runtime). Arguments after `--` go to vLLM unchanged.
    Example: sptool serve tiny --port 8001 --lora-rank 8 | sptool run --recipe svs --tiny
    --backend openai --set model.base_url=http://127.0.0.1:8001
    """
    import shlex

    from sptool.serve import ServeOptions, exec_server, server_command

    options = ServeOptions(model=model, host=host, port=port, served_model_name=served_model_name,
                           lora_rank=lora_rank, dtype=dtype, max_model_len=max_model_len,
                           gpu_memory_utilization=gpu_memory_utilization, device=device,
                           extra=list(ctx.args))
    argv, env = server_command(options)
    if print_command:
        flags = [f"{key}={env[key]}" for key in ("VLLM_SERVER_DEV_MODE", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")
                 if key in env]
        typer.echo(" ".join(flags + [shlex.join(argv)]))
        return
    exec_server(argv, env, log=lambda message: common.err_console.print(message, markup=False, soft_wrap=True))
