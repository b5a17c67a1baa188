"""The one generation protocol every backend implements, and the backend registry.

A prompt is either a list of chat messages (``[{"role": "user", "content": ...}]``) or a plain
string (base models without a chat template). A backend returns, for each prompt, ``n``
:class:`Sample`s.

Two things shape a reply, and every backend applies them the same way:

- a **response prefix**: chat messages that end with an assistant message. Its content is put
  right after the chat template's assistant header (``add_generation_prompt``), the model
  continues from there, and the returned ``Sample.text`` begins with it (parsing sees the whole
  reply); ``n_tokens``, ``logprobs`` and ``token_ids`` cover the generated tokens only;
- **stop strings** (``SamplingParams.stop``): generation ends at the first one to appear in the
  generated text; the text is cut right after it (the stop string is kept), ``finish_reason``
  is ``"stop"`` and ``Sample.stop_string`` names it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Union

from sptool.core.records import UsageError
from sptool.core.registry import Registry, unknown_name_error  # noqa: F401 (re-exported)

ChatMessages = list[dict[str, str]]
Prompt = Union[ChatMessages, str]


@dataclass
class SamplingParams:
    """How to sample: the knobs every backend honours."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 512
    seed: int = 0
    logprobs: bool = False  # return per-token log-probabilities of the sampled tokens
    stop: tuple[str, ...] = ()  # stop strings: generation ends at the first (kept in the text)
    # time.monotonic() by which generation must end (hf: generate's max_time; openai: the request
    # timeout); None: no limit. A caller with a deadline checks the clock after the call too.
    deadline: float | None = None

    def seconds_left(self) -> float | None:
        if self.deadline is None:
            return None
        import time

        return max(0.0, self.deadline - time.monotonic())

    def __post_init__(self) -> None:
        import math

        if not (math.isfinite(self.temperature) and math.isfinite(self.top_p)):
            raise UsageError(f"--temperature and --top-p must be finite numbers, got "
                             f"{self.temperature} and {self.top_p}")
        if self.temperature < 0:
            raise UsageError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise UsageError(f"--max-tokens must be >= 1, got {self.max_new_tokens}")
        self.stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(item, str) or not item for item in self.stop):
            raise UsageError(f"--stop strings must be non-empty, got {list(self.stop)}")


@dataclass
class Sample:
    """One generated completion."""

    text: str
    n_tokens: int
    finish_reason: str = "stop"  # "stop" (EOS/stop string) or "length"
    logprobs: list[float] | None = None
    token_ids: list[int] | None = field(default=None, repr=False)
    stop_string: str | None = None  # the stop string that ended it (None: EOS or length)

    def to_record(self) -> dict[str, Any]:
        """The sample's record fields, in the dataclass's order, without the ``None`` ones; the
        lists copied. Built by hand: ``dataclasses.asdict`` deep-copies element by element (512
        samples with 64 log-probabilities: 71 ms against a few)."""
        record: dict[str, Any] = {"text": self.text, "n_tokens": self.n_tokens, "finish_reason": self.finish_reason}
        if self.logprobs is not None:
            record["logprobs"] = list(self.logprobs)
            if self.token_ids is not None:  # kept beside sampling log-probs: a training group's own tokens
                record["token_ids"] = list(self.token_ids)
        if self.stop_string is not None:
            record["stop_string"] = self.stop_string
        return record


# Progress inside a long generation: a function the stage commands set (``tokens_generated(n)``,
# n new tokens over the batch), called by the hf backend after every decoding step, so a
# 512-token batch on a CPU shows progress from its first seconds instead of after minutes.
_token_listener: Callable[[int], None] | None = None


def set_token_listener(listener: Callable[[int], None] | None) -> None:
    global _token_listener
    _token_listener = listener


def token_listener() -> Callable[[int], None] | None:
    return _token_listener


def split_response_prefix(prompt: Prompt) -> tuple[Prompt, str]:
    """``(messages without the response prefix, prefix)``: a trailing assistant message is the
    start of the reply (``""`` when there is none, and for a plain-string prompt)."""
    if isinstance(prompt, list) and prompt and prompt[-1].get("role") == "assistant":
        return prompt[:-1], prompt[-1].get("content") or ""
    return prompt, ""


def cut_at_stop(text: str, stop: tuple[str, ...] | list[str]) -> tuple[str, str | None]:
    """``text`` up to and including the stop string that ends first, and that string
    (``(text, None)`` when none occurs). Ties (two ending at one place) go to the longer."""
    best: tuple[int, int, str] | None = None
    for item in stop:
        position = text.find(item)
        if position >= 0:
            key = (position + len(item), -len(item), item)
            if best is None or key < best:
                best = key
    if best is None:
        return text, None
    return text[:best[0]], best[2]


class Backend(Protocol):
    """What a generation backend must provide."""

    name: str
    model_id: str

    def generate(self, prompts: list[Prompt], n: int, params: SamplingParams) -> list[list[Sample]]:
        """``n`` samples for each prompt, in prompt order."""
        ...

    def close(self) -> None: ...


# name -> "module:attribute" (lazy, so `sptool --help` imports no torch)
BACKENDS: Registry[Callable[..., Backend]] = Registry("backend", {
    "hf": "sptool.models.hf:HFBackend",
    "scripted": "sptool.models.scripted:ScriptedBackend",
    "vllm": "sptool.models.vllm_backend:VLLMBackend",
    "openai": "sptool.models.openai_backend:OpenAIBackend",
})


def register_backend(name: str, target: str) -> None:
    """Register a backend factory given as ``"module:attribute"``."""
    BACKENDS.register(name, target)


def load_backend(name: str, model: str = "tiny", **options: Any) -> Backend:
    """Instantiate backend ``name`` for ``model`` (options are backend-specific)."""
    return BACKENDS.get(name)(model, **options)
