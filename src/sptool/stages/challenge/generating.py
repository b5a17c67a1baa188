"""What the three challenge stages share: prompts in, every completion out as a question record."""

from __future__ import annotations

import dataclasses
from typing import Any

from sptool.models.base import Backend, Prompt, Sample, SamplingParams
from sptool.prompts import PromptSpec, load_prompt
from sptool.core.records import UsageError
from sptool.core.stage import Stage


def continue_reply(text: str, continuation: str) -> str:
    """``text`` continued with ``continuation``, without repeating what ``text`` already ends
    with (``"…?</question>"`` + ``"</question>\\n\\boxed{"`` → ``"…?</question>\\n\\boxed{"``)."""
    for overlap in range(min(len(text), len(continuation)), 0, -1):
        if text.endswith(continuation[:overlap]):
            return text + continuation[overlap:]
    return text + continuation


# ---------------------------------------------------------------- shared record building

def _sample_fields(sample: Sample) -> dict[str, Any]:
    fields: dict[str, Any] = {"raw": sample.text, "n_tokens": sample.n_tokens,
                              "finish_reason": sample.finish_reason}
    if sample.logprobs is not None:
        fields["logprobs"] = sample.logprobs
    if sample.stop_string is not None:
        fields["stop_string"] = sample.stop_string
    return fields


class _GeneratingStage(Stage):
    """What the three challenge stages share: backend, sampling params, prompt, batching."""

    role = ""  # the prompt role (sptool.prompts.ROLES)

    def __init__(self, backend: Backend, *, candidates: int = 8, params: SamplingParams | None = None,
                 prompt: str | PromptSpec | None = None, batch_size: int = 4):
        super().__init__()
        if candidates < 1:
            raise UsageError(f"--candidates must be >= 1, got {candidates}")
        if batch_size < 1:
            raise UsageError(f"--prompts-per-call/--group-size must be >= 1, got {batch_size}")
        self.backend = backend
        self.candidates = candidates
        self.prompt = prompt if isinstance(prompt, PromptSpec) else load_prompt(self.role, prompt)
        self.params = self.prompt.sampling(params or SamplingParams())
        self.batch_size = batch_size
        self._calls = 0

    def _generate(self, prompts: list[Prompt], n: int, params: SamplingParams | None = None
                  ) -> list[list[Sample]]:
        """One backend call; the seed moves with the call number so batches differ but reruns match."""
        params = params or self.params
        params = dataclasses.replace(params, seed=self.params.seed * 7919 + self._calls)
        self._calls += 1
        return self.backend.generate(prompts, n, params)

    @property
    def model_id(self) -> str | None:
        return getattr(self.backend, "model_id", None)

    def _count_validity(self, record: dict) -> None:
        if record["valid"]:
            self.stats.notes["valid"] += 1
        else:
            self.stats.notes[f"invalid ({record['invalid_reason']})"] += 1

    def close(self) -> None:
        self.backend.close()

    def _answer_phase(self, prompt: list[dict[str, str]], samples: list[Sample]) -> list[Sample]:
        """Continue every question that stopped with ``answer_prefix`` and generate its answer."""
        spec = self.prompt
        todo = [index for index, sample in enumerate(samples) if sample.finish_reason == "stop"]
        if not todo:
            return samples
        user = [message for message in prompt if message.get("role") != "assistant"]
        continued = [user + [{"role": "assistant", "content": continue_reply(samples[i].text, spec.answer_prefix)}]
                     for i in todo]
        params = dataclasses.replace(self.params, stop=tuple(spec.answer_stop),
                                     max_new_tokens=spec.answer_max_tokens, logprobs=False)
        answers = self._generate(continued, 1, params)
        merged = list(samples)
        for index, outputs in zip(todo, answers):
            first, second = samples[index], outputs[0]
            merged[index] = Sample(text=second.text, n_tokens=first.n_tokens + second.n_tokens,
                                   finish_reason=second.finish_reason, stop_string=second.stop_string)
        return merged
