"""The one generation protocol every backend implements, and the backend registry.

A prompt is either a list of chat messages (``[{"role": "user", "content": ...}]``) or a plain
string (base models without a chat template). A backend returns, for each prompt, ``n``
:class:`Sample`s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Protocol, Union

from sptool.records import UsageError
from sptool.registry import Registry, unknown_name_error  # noqa: F401 (re-exported)

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

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise UsageError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise UsageError(f"--max-tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class Sample:
    """One generated completion."""

    text: str
    n_tokens: int
    finish_reason: str = "stop"  # "stop" (EOS/stop string) or "length"
    logprobs: list[float] | None = None
    token_ids: list[int] | None = field(default=None, repr=False)

    def to_record(self) -> dict[str, Any]:
        record = asdict(self)
        record.pop("token_ids")
        if record["logprobs"] is None:
            record.pop("logprobs")
        return record


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
