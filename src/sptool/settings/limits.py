"""Range checks for numeric options, by parameter name, run before any command does any work.

Every command's callback is wrapped (in :mod:`sptool.cli.main`) so that its numeric options are
checked first: floats must be finite (``inf``, ``nan`` are refused) and within a sensible range,
integers within bounds that also cap accidental huge values (``-k 10^23`` would allocate until
the machine runs out of memory). A violation is one :class:`UsageError` line, exit 2.

The same name means the same thing in every command (``--seed``, ``--timeout``, ``--deadline``),
so one table serves them all; an option not in the table is not checked here.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

from sptool.core.records import UsageError

MAX_SAMPLES = 4096          # -k: generations per question
MAX_PATHS = 100_000         # tree expand --paths
MAX_SEED = 2**32 - 1        # numpy/torch seeds


@dataclass(frozen=True)
class Limit:
    low: float | None = None
    high: float | None = None
    low_open: bool = False    # low < value (else low <= value)
    high_open: bool = False
    integer: bool = False
    why: str = ""             # said when the upper bound is exceeded

    def problem(self, value: Any) -> str | None:
        if value is None or isinstance(value, bool):
            return None
        if isinstance(value, (list, tuple)):
            for item in value:
                problem = self.problem(item)
                if problem:
                    return problem
            return None
        if not isinstance(value, (int, float)):
            return None
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number, got {value}"
        too_low = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        too_high = self.high is not None and (value >= self.high if self.high_open else value > self.high)
        if too_low or too_high:
            text = f"must be {self.describe()}, got {value}"
            if too_high and self.why:
                text += f" ({self.why})"
            return text
        return None

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        if self.low is not None and self.high is not None:
            return (f"in {'(' if self.low_open else '['}{_fmt(self.low)}, {_fmt(self.high)}"
                    f"{')' if self.high_open else ']'}")
        if self.low is not None:
            return f"{kind} {'>' if self.low_open else '>='} {_fmt(self.low)}"
        return f"{kind} {'<' if self.high_open else '<='} {_fmt(self.high)}"


def _fmt(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def ints(low: int | None, high: int | None, why: str = "") -> Limit:
    return Limit(low, high, integer=True, why=why)


def floats(low: float | None = None, high: float | None = None, *, low_open: bool = False,
           high_open: bool = False) -> Limit:
    return Limit(low, high, low_open=low_open, high_open=high_open)


#: parameter name (the Python name of the option) -> its limit
LIMITS: dict[str, Limit] = {
    # how much work: capped so that a typo cannot fill the memory or the disk
    "samples": ints(1, MAX_SAMPLES, "generations per question"),
    "compare": ints(1, 1024, "judgements per candidate"),
    "partners": ints(1, 1024, "judgements per candidate"),
    "questions_per_call": ints(1, 1_000_000),
    "prompts_per_call": ints(1, 1_000_000),
    "group_size": ints(1, 1_000_000),
    "candidates_per_batch": ints(1, 10_000_000),
    "candidates": ints(1, 1024, "generations per input record"),
    "paths": ints(1, MAX_PATHS, "paths per expansion"),
    "results": ints(1, 1000),
    "batch_size": ints(1, 10_000_000),
    "gen_batch_size": ints(1, 65_536),
    "max_tokens": ints(1, 1_000_000),
    "max_solutions": ints(1, 4096),
    "max_document_chars": ints(1, 100_000_000),
    "min_chars": ints(0, 100_000_000),
    "max_bytes": ints(1, 2**31, "bytes per response"),
    "concurrency": ints(1, 1024),
    "workers": ints(0, 1024),
    "retries": ints(0, 100),
    "max_attempts": ints(1, 1000),
    "proposals": ints(1, 1000),
    "min_votes": ints(1, 1000),
    "max_children": ints(1, 100_000),
    "max_depth": ints(1, 64),
    "window": ints(1, 100_000),
    "groups_per_update": ints(0, None),
    "lora_r": ints(0, 65_536),
    "max_tokens_per_micro_batch": ints(1, None),
    "normaliser_length": ints(1, None),
    "tensor_parallel_size": ints(1, 1024),
    "seed": ints(0, MAX_SEED),
    "n": ints(1, 10_000_000, "problems per task"),
    "iterations": ints(1, 1_000_000, "outer iterations"),
    "min_words": ints(1, 100_000),
    "ngram": ints(1, 10_000),
    "max_model_len": ints(1, 10_000_000),
    "gpu_memory_utilization": floats(0, 1, low_open=True),
    # times (seconds): finite and positive
    "deadline": floats(0, 7 * 86400, low_open=True),
    "timeout": floats(0, 86400, low_open=True),
    "wiki_timeout": floats(0, 86400, low_open=True),
    "backoff": floats(0, 3600),
    "delay": floats(0, 3600),
    # sampling
    "temperature": floats(0, 100),
    "top_p": floats(0, 1, low_open=True),
    # training
    "learning_rate": floats(0, 1, low_open=True),
    "beta": floats(0, 1e6),
    "weight_decay": floats(0, 1e3),
    "max_grad_norm": floats(0, 1e6),
    "clip_low": floats(0, 1, high_open=True),
    "clip_high": floats(0, 100),
    "tis_cap": floats(0, 1e6),
    "lora_alpha": floats(0, 1e6, low_open=True),
    "lora_dropout": floats(0, 1, high_open=True),
    # rewards, gates and thresholds
    "sigma": floats(0, 1e6, low_open=True),
    "invalid_penalty": floats(-1e6, 1e6),
    "format_weight": floats(0, 1),
    "replay_share": floats(0, 1, high_open=True),
    "bleu_threshold": floats(0, 1),
    "tau_var": floats(0, 1),
    "group_threshold": floats(-1e6, 1e6),
    "tau_emb": floats(-1, 1),
    "tau_wiki": floats(0, 1),
    "duplicate_threshold": floats(0, 1),
    "dedup": floats(0, 1),
}


DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = ("auto", "bf16", "bfloat16", "fp16", "float16", "fp32", "float32")
MIXED_PRECISIONS = ("no", "bf16", "fp16")


def device_error(value: str) -> str | None:
    """``cpu``, ``cuda``, ``cuda:N``, ``mps``, ``auto`` (or empty: the default); else what is wrong."""
    import re

    if value in ("", *DEVICES) or re.fullmatch(r"cuda:\d{1,4}", value):
        return None
    from sptool.core.registry import unknown_name_error

    return str(unknown_name_error("device", value, [*DEVICES, "cuda:N"]))


def _objectives() -> list[str]:
    from sptool.train.losses import OBJECTIVES

    return OBJECTIVES.names()


def _backends() -> list[str]:
    from sptool.models.base import BACKENDS

    return BACKENDS.names()


#: parameter name -> its allowed values (a tuple, or a function of none returning them); checked
#: with did-you-mean before any work, by option and by recipe setting alike
CHOICES: dict[str, Any] = {
    "dtype": DTYPES,
    "mixed_precision": MIXED_PRECISIONS,
    "old_logprobs": ("auto", "sampler", "trainer"),
    "weight_rounding": ("auto", "nearest", "split", "stochastic"),
    "wiki_api": ("search", "opensearch"),
    "loss": _objectives,
    "backend": _backends,
}


#: string options that an empty value would turn into nonsense (``--stop ''`` ends every
#: generation before its first token)
NON_EMPTY_STRINGS = frozenset({"stop"})


def choice_error(name: str, value: Any) -> str | None:
    """What is wrong with ``value`` for the choice parameter ``name`` (None: fine or not a choice)."""
    if value is None or not isinstance(value, str):
        return None
    if name == "device":
        return device_error(value)
    allowed = CHOICES.get(name)
    if allowed is None:
        return None
    names = list(allowed() if callable(allowed) else allowed)
    if value in names or (value == "" and name in ("dtype",)):
        return None
    from sptool.core.registry import unknown_name_error

    return str(unknown_name_error(name.replace("_", " "), value, names))


def option_name(name: str) -> str:
    """``--the-option`` (with its short form) for a parameter name, from the running command."""
    from sptool.core.fsguard import _current_context

    context = _current_context()
    if context is not None:
        for param in getattr(context.command, "params", []):
            if param.name == name:
                opts = [o for o in getattr(param, "opts", []) if o.startswith("-")]
                if opts:
                    return "/".join(sorted(opts, key=len))
    return "--" + name.replace("_", "-")


def check_options(values: dict[str, Any]) -> None:
    """Refuse the first option whose value breaks its :data:`LIMITS` entry (one line, exit 2)."""
    for name, value in values.items():
        if name in NON_EMPTY_STRINGS and isinstance(value, (list, tuple)) and any(v == "" for v in value):
            raise UsageError(f"{option_name(name)} must be a non-empty string, got ''")
        problem = choice_error(name, value)
        if problem:
            raise UsageError(f"{option_name(name)}: {problem}")
        limit = LIMITS.get(name)
        if limit is None:
            continue
        problem = limit.problem(value)
        if problem:
            raise UsageError(f"{option_name(name)} {problem}")


def checked(callback: Callable) -> Callable:
    """Wrap a command callback so that its options are checked before it runs."""
    if getattr(callback, "__sptool_checked__", False):
        return callback

    @functools.wraps(callback)
    def run(*args: Any, **kwargs: Any) -> Any:
        check_options(kwargs)
        return callback(*args, **kwargs)

    run.__sptool_checked__ = True
    return run
