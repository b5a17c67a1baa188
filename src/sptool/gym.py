"""Labelled problem sets from reasoning-gym's procedural generators, and their graders.

``sptool data gym TASK… -n N --seed S`` writes, per task, N records::

    {"id": "basic_arithmetic-0-7", "question": "...", "answer": "-4", "task": "basic_arithmetic",
     "grader": "math-verify", "gym": {"seed": 0, "index": 7, "config": {}}, "metadata": {...}}

The same arguments give the same file (reasoning-gym's generators are seeded). Tasks whose
answer is one number or expression (:data:`MATH_TASKS`) are graded by math-verify like any
labelled problem; every other task keeps ``grader: "reasoning-gym"`` and is graded by the task's
own ``score_answer`` (``verify`` rebuilds the task with the stored ``config`` and scores the
sample's answer against the stored ``answer`` and ``metadata``).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, Iterator

from sptool.core.jsonl import loads_strict
from sptool.core.records import RuntimeFailure, UsageError, content_id

# Tasks whose answer is a single number, fraction or expression that math-verify's equivalence
# grades as the task means it. Others (e.g. fraction_simplification, which wants lowest terms,
# or word_sorting) use the task's own scorer.
MATH_TASKS = frozenset({
    "basic_arithmetic", "chain_sum", "decimal_chain_sum", "simple_equations", "gcd", "lcm",
    "leg_counting", "count_primes", "products", "gsm_symbolic", "count_bits", "rectangle_count",
    "number_sequence", "simple_geometry", "dice", "coin_flip",
})

INSTALL_HINT = "reasoning-gym is not installed: pip install 'sptool[gym]' (or pip install reasoning-gym)"


def _reasoning_gym():
    try:
        import reasoning_gym
    except ImportError:
        raise RuntimeFailure(INSTALL_HINT) from None
    return reasoning_gym


def available_tasks() -> list[str]:
    _reasoning_gym()  # importing the package registers every task
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def check_task(name: str) -> None:
    tasks = available_tasks()
    if name not in tasks:
        from sptool.core.registry import unknown_name_error

        raise unknown_name_error("reasoning-gym task", name, tasks,
                                 choices="`sptool data gym --list` lists every task")


def _plain(value: Any) -> Any:
    """A JSON-safe copy of task metadata (tuples → lists, sets → sorted lists, numpy → Python)."""
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_plain(item) for item in value), key=repr)
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return value.item()
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def make_dataset(task: str, *, size: int, seed: int, config: dict | None = None):
    rg = _reasoning_gym()
    try:
        return rg.create_dataset(task, size=size, seed=seed, **(config or {}))
    except (TypeError, ValueError, AssertionError) as error:
        raise UsageError(f"reasoning-gym task '{task}': bad --param ({error})") from None


def generate(task: str, *, n: int, seed: int, config: dict | None = None) -> Iterator[dict]:
    """``n`` labelled records of ``task`` (deterministic in ``seed`` and ``config``)."""
    check_task(task)
    config = dict(config or {})
    dataset = make_dataset(task, size=n, seed=seed, config=config)
    suffix = f"-{content_id(_plain(config), length=8)}" if config else ""  # other params, other ids
    for index in range(n):
        entry = dataset[index]
        metadata = _plain(entry.get("metadata") or {})
        yield {"id": f"{task}-{seed}-{index}{suffix}", "question": entry["question"], "answer": str(entry["answer"]),
               "task": task, "grader": "math-verify" if task in MATH_TASKS else "reasoning-gym",
               "gym": {"seed": seed, "index": index, "config": _plain(config)}, "metadata": metadata}


#: the largest magnitude of a numeric ``--param`` (``max_digits=1e308`` hung the generator)
MAX_PARAM = 1e6


def parse_params(params: list[str]) -> dict:
    """``KEY=VALUE`` pairs (VALUE as JSON when it parses, else a string)."""
    config = {}
    for item in params:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--param expects KEY=VALUE, got '{item}'")
        try:
            config[key.strip()] = loads_strict(value)
        except ValueError:  # not JSON (or a refused value): the text itself
            config[key.strip()] = value
        number = config[key.strip()]
        if isinstance(number, (int, float)) and not isinstance(number, bool) and abs(number) > MAX_PARAM:
            raise UsageError(f"--param {key.strip()}={value}: must be within ±{MAX_PARAM:g} (a larger "
                             "task parameter makes generation unbounded)")
    return config


# ---------------------------------------------------------------- grading (in verify's workers)

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_STATED = re.compile(r"(?:final answer|answer)\s*(?:is|:)\s*(.+?)\s*\.?\s*$", re.IGNORECASE)
_TEXT = re.compile(r"^\\(?:text|mathrm|textbf)\{(.*)\}$", re.DOTALL)


def plain_answer(text: str, boxed: str | None, *, require_boxed: bool = False) -> str | None:
    """A non-mathematical task's answer: the boxed content (``\\text{…}`` unwrapped), else a
    reasoning-gym ``<answer>…</answer>`` tag, else an "answer is …" / "Answer: …" last line."""
    if boxed is not None:
        match = _TEXT.match(boxed.strip())
        return (match.group(1) if match else boxed).strip()
    if require_boxed:
        return None
    tags = _ANSWER_TAG.findall(text)
    if tags and tags[-1].strip():
        return tags[-1].strip()
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if lines:
        stated = _STATED.search(lines[-1])
        if stated:
            return stated.group(1).strip().strip("$").strip()
    return None


@functools.lru_cache(maxsize=64)
def _scorer(task: str, config_json: str):
    return make_dataset(task, size=1, seed=0, config=loads_strict(config_json))


def task_score(task: str, config: dict, entry: dict, answer: str | None) -> float:
    """The task's own ``score_answer`` (1.0 is right; some tasks give partial credit)."""
    dataset = _scorer(task, json.dumps(config, sort_keys=True))
    return float(dataset.score_answer(answer, entry))


def normalised_plain(answer: str) -> str:
    """For majority votes over non-mathematical answers: case and spacing do not matter."""
    return " ".join(answer.casefold().split())
