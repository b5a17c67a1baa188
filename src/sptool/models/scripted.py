"""A scripted backend: returns queued outputs, for fast deterministic tests and debugging.

``--backend scripted -m FILE`` reads FILE as JSONL; each line is a string (one output) or an
object ``{"match": REGEX, "output": TEXT}``. Outputs are handed out in order, cycling when the
queue is exhausted; a ``match`` line is used whenever its regex matches the rendered prompt.
``{"match": REGEX, "outputs": [A, B, …]}`` gives sample i of a prompt ``outputs[i % len]``
(deterministic per prompt, so a resumed run sees the same outputs).
From Python, pass ``outputs=[...]`` or ``responder=lambda prompt_text, sample_index: text``.

Like every backend, a response prefix (a trailing assistant message) starts the returned text (a
scripted output that already begins with the prefix is taken as the whole reply) and the output
is cut after the first stop string (``finish_reason`` "stop", ``stop_string`` set).
"""

from __future__ import annotations

import re
from typing import Callable

from sptool.models.base import Prompt, Sample, SamplingParams, cut_at_stop, split_response_prefix
from sptool.core.records import InputError, describe


class ScriptedBackend:
    name = "scripted"

    def __init__(self, model: str | None = None, *, outputs: list[str] | None = None,
                 responder: Callable[[str, int], str] | None = None, **_):
        self.model_id = model or "scripted"
        self.rules: list[tuple[re.Pattern, str | list[str]]] = []
        self.queue: list[str] = list(outputs or [])
        self.responder = responder
        self.calls: list[list[str]] = []
        if model and model not in ("scripted", "tiny") and not outputs and not responder:
            self._load(model)
        if not self.queue and not self.rules and responder is None:
            self.queue = [""]
        self._position = 0

    def _load(self, path: str) -> None:
        from sptool.core.jsonl import decode_json, iter_lines

        try:
            handle = open(path, "rb")
        except OSError as exc:
            raise InputError(f"cannot read script: {exc.strerror}", source=path) from None
        with handle:
            for number, line in iter_lines(handle, path):
                if not line.strip():
                    continue
                value = decode_json(line, source=path, line=number)
                if isinstance(value, str):
                    self.queue.append(value)
                elif isinstance(value, dict) and isinstance(value.get("output"), str):
                    self.rules.append((_pattern(value, path, number), value["output"]))
                elif isinstance(value, dict) and isinstance(value.get("outputs"), list) and value["outputs"] \
                        and all(isinstance(item, str) for item in value["outputs"]):
                    self.rules.append((_pattern(value, path, number), list(value["outputs"])))
                else:
                    raise InputError("expected a string, {\"match\", \"output\"} or {\"match\", \"outputs\": [...]}", source=path,
                                     line=number)

    @staticmethod
    def render(prompt: Prompt) -> str:
        if isinstance(prompt, str):
            return prompt
        return "\n\n".join(message["content"] for message in prompt)

    def _next(self, text: str, sample_index: int) -> str:
        if self.responder is not None:
            return self.responder(text, sample_index)
        for pattern, output in self.rules:
            if pattern.search(text):
                return output if isinstance(output, str) else output[sample_index % len(output)]
        if not self.queue:
            raise InputError(f"no rule matches the prompt and no plain output is queued (prompt starts "
                             f"{text[:60]!r})", source=self.model_id)
        output = self.queue[self._position % len(self.queue)]
        self._position += 1
        return output

    def generate(self, prompts: list[Prompt], n: int, params: SamplingParams) -> list[list[Sample]]:
        results = []
        rendered = [self.render(p) for p in prompts]
        self.calls.append(rendered)
        for prompt, text in zip(prompts, rendered):
            prefix = split_response_prefix(prompt)[1]
            samples = []
            for index in range(n):
                output = self._next(text, index)
                if prefix and output.startswith(prefix):
                    output = output[len(prefix):]
                output, stop_string = cut_at_stop(output, params.stop)
                n_tokens = max(1, len(output.split()))
                logprobs = [-1.0] * n_tokens if params.logprobs else None
                samples.append(Sample(text=prefix + output, n_tokens=n_tokens, logprobs=logprobs,
                                      stop_string=stop_string))
            results.append(samples)
        return results

    def close(self) -> None:
        pass


def _pattern(rule: dict, source: str, line: int) -> re.Pattern:
    """A rule's ``match`` regular expression; a bad one is one error at ``source:line``."""
    match = rule.get("match", "")
    if not isinstance(match, str):
        raise InputError(f"expected a string (a regular expression), got {describe(match)}",
                         source=source, line=line, field="match")
    try:
        return re.compile(match)
    except re.error as exc:
        raise InputError(f"not a valid regular expression ({exc})", source=source, line=line,
                         field="match") from None
