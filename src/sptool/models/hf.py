"""The ``hf`` backend: batched sampling with transformers' ``generate`` (left padding, KV cache).

Runs on CPU or GPU. Deterministic under a seed for the same prompts, ``n`` and batch size: the
torch generator is re-seeded from ``(seed, batch index)`` before every batch.
"""

from __future__ import annotations

import os
from typing import Any

from sptool.models.base import Prompt, Sample, SamplingParams, cut_at_stop, split_response_prefix, token_listener
from sptool.models.resolve import resolve_model
from sptool.records import RuntimeFailure, UsageError


def pick_device(device: str | None) -> str:
    import torch

    if device in (None, "", "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeFailure(f"--device {device} asked for, but torch sees no CUDA GPU")
    return device


def pick_dtype(dtype: str | None, device: str):
    import torch

    if dtype in (None, "", "auto"):
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
             "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}
    if dtype not in table:
        raise UsageError(f"unknown --dtype '{dtype}'; choose from auto, {', '.join(table)}")
    return table[dtype]


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def render_prompt(tokenizer, prompt: Prompt, chat_template: bool = True) -> str:
    """The exact text the model sees: chat template with generation prompt, or plain text, then
    the response prefix (a trailing assistant message) if any.

    Shared by every backend and by ``train-step`` so training scores exactly what was sampled.
    """
    messages, prefix = split_response_prefix(prompt)
    if isinstance(messages, str):
        return messages + prefix
    if chat_template and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + prefix
    return "\n\n".join(message["content"] for message in messages) + "\n\n" + prefix


class HFBackend:
    """Generation with a transformers causal LM (a hub id, a local directory, or ``tiny``)."""

    name = "hf"

    def __init__(self, model: str = "tiny", *, device: str | None = None, dtype: str | None = None,
                 batch_size: int = 64, chat_template: bool = True, static_cache: bool = False,
                 compile: bool = False, log=None, **_: Any):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()

        path = resolve_model(model, log=log)
        device = pick_device(device)
        torch_dtype = pick_dtype(dtype, device)
        try:
            tokenizer = load_tokenizer(path)
            if os.path.isfile(os.path.join(path, "adapter_config.json")):
                from peft import AutoPeftModelForCausalLM

                model_obj = AutoPeftModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
                model_obj = model_obj.merge_and_unload()
            else:
                model_obj = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
        except OSError as exc:
            from sptool.models.resolve import load_failure

            raise load_failure(model, exc) from None
        self._attach(model_obj.to(device).eval(), tokenizer, model_id=model, path=path, device=device,
                     batch_size=batch_size, chat_template=chat_template)
        # Faster decoding on GPU: a static (pre-allocated) KV cache, which transformers' generate
        # compiles the decoding step for (torch.compile, CUDA graphs) when `compile` is set.
        if static_cache or compile:
            self.generate_options["cache_implementation"] = "static"
            self.model.generation_config.disable_compile = not compile

    @classmethod
    def from_model(cls, model, tokenizer=None, *, model_id: str, batch_size: int = 64,
                   chat_template: bool = True) -> "HFBackend":
        """A backend over an already loaded ``model`` (e.g. a trainer's policy: no copy, so it
        always generates with the current weights). ``tokenizer`` None: loaded from ``model_id``.
        The caller keeps owning the model; :meth:`close` only drops this reference."""
        backend = cls.__new__(cls)
        backend._attach(model, tokenizer if tokenizer is not None else load_tokenizer(model_id),
                        model_id=model_id, path=model_id, batch_size=batch_size, chat_template=chat_template)
        return backend

    def _attach(self, model, tokenizer, *, model_id: str, path: str, batch_size: int, chat_template: bool,
                device: str | None = None) -> None:
        """Every attribute a backend has, set in one place (by ``__init__`` and ``from_model``)."""
        import torch

        parameter = next(model.parameters())
        self.model_id, self.path = model_id, path
        self.device = device or str(parameter.device)
        self.dtype = parameter.dtype
        self.batch_size = max(1, int(batch_size))
        self.chat_template = chat_template
        tokenizer.padding_side = "left"
        self.tokenizer = tokenizer
        self.model = model
        self._torch = torch
        self.generate_options: dict[str, Any] = {}

    def render(self, prompt: Prompt) -> str:
        return render_prompt(self.tokenizer, prompt, self.chat_template)

    def generate(self, prompts: list[Prompt], n: int, params: SamplingParams) -> list[list[Sample]]:
        torch = self._torch
        self.model.eval()  # a shared trainer's model may be left in train mode (dropout)
        texts = [self.render(p) for p in prompts]
        prefixes = [split_response_prefix(p)[1] for p in prompts]
        jobs = [(index, text) for index, text in enumerate(texts) for _ in range(n)]
        results: list[list[Sample]] = [[] for _ in prompts]
        eos_ids = self._eos_ids()
        for batch_index in range(0, len(jobs), self.batch_size):
            batch = jobs[batch_index:batch_index + self.batch_size]
            encoded = self.tokenizer([text for _, text in batch], return_tensors="pt", padding=True,
                                     add_special_tokens=False).to(self.device)
            sampling = params.temperature > 0
            options: dict[str, Any] = dict(
                max_new_tokens=params.max_new_tokens, do_sample=sampling,
                pad_token_id=self.tokenizer.pad_token_id, eos_token_id=eos_ids,
                return_dict_in_generate=True, output_logits=params.logprobs,
            )
            options.update(self.generate_options)
            if params.stop:
                options.update(stop_strings=list(params.stop), tokenizer=self.tokenizer)
            left = params.seconds_left()
            if left is not None:
                if left <= 0:
                    break  # past the deadline: the caller sees missing samples and drops the batch
                options["max_time"] = left
            if sampling:
                options.update(temperature=params.temperature, top_p=params.top_p, top_k=0)
            else:
                options.update(temperature=None, top_p=None, top_k=None)
            listener = token_listener()
            if listener is not None:
                options["stopping_criteria"] = _token_progress(listener)
            torch.manual_seed(params.seed * 1_000_003 + batch_index)
            with torch.inference_mode():
                output = self.model.generate(**encoded, **options)
            new_tokens = output.sequences[:, encoded["input_ids"].shape[1]:].tolist()
            logprob_rows = None
            if params.logprobs:
                stacked = torch.stack(output.logits, dim=1).float()  # batch, steps, vocab
                chosen = torch.tensor(new_tokens, device=stacked.device).unsqueeze(-1)
                logprob_rows = torch.log_softmax(stacked, dim=-1).gather(-1, chosen).squeeze(-1).tolist()
            for row, (prompt_index, _) in enumerate(batch):
                ids = new_tokens[row]
                finish = "length"
                for position, token in enumerate(ids):
                    if token in eos_ids:
                        ids = ids[:position + 1]
                        finish = "stop"
                        break
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                stop_string = None
                if params.stop:
                    ids, text, stop_string = self._cut_at_stop(ids, text, params.stop)
                    finish = "stop" if stop_string is not None else finish
                logprobs = logprob_rows[row][:len(ids)] if logprob_rows is not None else None
                results[prompt_index].append(Sample(text=prefixes[prompt_index] + text, n_tokens=len(ids),
                                                    finish_reason=finish, logprobs=logprobs,
                                                    token_ids=ids, stop_string=stop_string))
        return results

    def _cut_at_stop(self, ids: list[int], text: str, stop) -> tuple[list[int], str, str | None]:
        """Ids, text and stop string when a stop string ends the text: the text is cut right after
        it, the ids after the first token that completes it (found by bisection)."""
        text, stop_string = cut_at_stop(text, stop)
        if stop_string is None:
            return ids, text, None
        low, high = 1, len(ids)  # the shortest prefix of ids whose text holds the stop string
        while low < high:
            middle = (low + high) // 2
            if cut_at_stop(self.tokenizer.decode(ids[:middle], skip_special_tokens=True), stop)[1]:
                high = middle
            else:
                low = middle + 1
        return ids[:low], text, stop_string

    def _eos_ids(self) -> list[int]:
        ids = self.model.generation_config.eos_token_id
        ids = list(ids) if isinstance(ids, (list, tuple)) else [ids] if ids is not None else []
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in ids:
            ids.append(self.tokenizer.eos_token_id)
        return ids

    def close(self) -> None:
        self.model = None


def _token_progress(listener):
    """A stopping criterion that never stops: it tells ``listener`` after every decoding step how
    many rows got a new token (the progress of a long generation)."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class TokenProgress(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            listener(int(input_ids.shape[0]))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([TokenProgress()])
