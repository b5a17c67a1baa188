"""Answer extraction, equivalence (math-verify) and majority vote, in killable worker processes.

For each solved question with samples ``y_1..y_K``:

- the final answer of each sample is the content of its last ``\\boxed{…}``; ``INVALID`` there
  (R-Quest's validity mode) counts towards ``invalid_frac`` u = #INVALID / K;
- correctness uses math-verify with the gold answer first (``verify(gold, pred)``; it is not
  symmetric);
- answers are grouped into equivalence classes by math-verify (not string equality); the
  largest class is the ``majority`` and ``majority_frac`` s = |class| / K (R-Zero's p, R-Quest's s);
- with no reference answer (pseudo-label mode) a sample is correct when it is in the majority
  class;
- p̂ = mean correctness, Var = p̂ (1 − p̂) (WIST's learnability signal).

Model text is only ever parsed (latex2sympy), never evaluated as code.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Iterator

from sptool.records import SOLVED, answer_text
from sptool.rewards import empirical_accuracy, empirical_variance
from sptool.stage import Stage
from sptool.workers import DeadlinePool, TaskFailed, TaskTimeout

INVALID = "INVALID"
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{…}`` in ``text`` (balanced braces), or None."""
    matches = list(_BOXED.finditer(text))
    for match in reversed(matches):
        depth, start = 1, match.end()
        for position in range(start, len(text)):
            char = text[position]
            if char == "{":
                depth += 1
            elif char == "}":
                depth -= 1
                if depth == 0:
                    content = text[start:position].strip()
                    return content or None
    return None


def extract_final_answer(text: str) -> str | None:
    """The sample's final answer: the last boxed content; ``INVALID`` normalised."""
    answer = last_boxed(text)
    if answer is None:
        return None
    if re.fullmatch(r"(\\text\{)?\s*invalid\s*\}?", answer, flags=re.IGNORECASE):
        return INVALID
    return answer


# ---------------------------------------------------------------- worker side (pure functions)

@functools.lru_cache(maxsize=65536)
def parse_answer(answer: str):
    """math-verify's parse of a final answer (cached; runs inside a worker process)."""
    from math_verify import parse

    parsed = parse("\\boxed{" + answer + "}", parsing_timeout=5)
    if not parsed:
        parsed = parse(answer, parsing_timeout=5)
    return parsed


@functools.lru_cache(maxsize=262144)
def answers_equivalent(gold: str, predicted: str) -> bool:
    """math-verify equivalence, gold first (cached on the pair of strings)."""
    if gold == predicted:
        return True
    from math_verify import verify

    gold_parsed, predicted_parsed = parse_answer(gold), parse_answer(predicted)
    if not gold_parsed or not predicted_parsed:
        return False
    return bool(verify(gold_parsed, predicted_parsed, timeout_seconds=5))


def majority_classes(answers: list[str | None]) -> list[list[int]]:
    """Equivalence classes (indices into ``answers``) of the non-empty, non-INVALID answers.

    Each answer joins the first class whose representative it is equivalent to (checked both
    ways, since math-verify is not symmetric); classes are returned largest first, ties by first
    occurrence.
    """
    classes: list[list[int]] = []
    for index, answer in enumerate(answers):
        if answer is None or answer == INVALID:
            continue
        for members in classes:
            representative = answers[members[0]]
            if answers_equivalent(representative, answer) or answers_equivalent(answer, representative):
                members.append(index)
                break
        else:
            classes.append([index])
    return sorted(classes, key=lambda members: (-len(members), members[0]))


def warm_up() -> None:
    """Import math-verify (and sympy) and exercise it once, before any deadline starts."""
    answers_equivalent("1", "1.0")


def grade(task: dict) -> dict:
    """Grade one solved question: ``{"texts": [...], "gold": str|None}`` → verdict fields."""
    texts: list[str] = task["texts"]
    gold: str | None = task["gold"]
    k = len(texts)
    answers = [extract_final_answer(text) for text in texts]
    classes = majority_classes(answers)
    majority_members = set(classes[0]) if classes else set()
    majority = answers[classes[0][0]] if classes else None
    if gold is not None:
        correct = [a is not None and a != INVALID and answers_equivalent(gold, a) for a in answers]
        label_source = "reference"
    else:
        correct = [index in majority_members for index in range(k)]
        label_source = "majority"
    p_hat = empirical_accuracy(correct)
    return {
        "answers": answers,
        "correct": correct,
        "p_hat": p_hat,
        "var": empirical_variance(p_hat),
        "majority": majority,
        "majority_frac": len(majority_members) / k if k else 0.0,
        "invalid_frac": sum(a == INVALID for a in answers) / k if k else 0.0,
        "n_classes": len(classes),
        "label_source": label_source,
    }


# ---------------------------------------------------------------- the stage

SUMMARY_FIELDS = ("p_hat", "var", "majority", "majority_frac", "invalid_frac", "n_classes",
                  "label_source")

class VerifyStage(Stage):
    """Adds per-sample ``answer``/``correct`` and ``p_hat``, ``var``, ``majority``,
    ``majority_frac``, ``invalid_frac`` to each solved question.

    A question whose grading overruns ``deadline_s`` is emitted with ``verify_error`` (and null
    statistics) instead of hanging the stage.
    """

    name = "verify"
    input_kind = SOLVED

    def __init__(self, *, workers: int = 2, deadline_s: float = 30.0, pseudo_label: bool = False):
        super().__init__()
        self.pool = DeadlinePool(grade, workers=workers, deadline_s=deadline_s, warmup=warm_up)
        self.pseudo_label = pseudo_label

    def _task(self, record: dict) -> dict:
        gold = None if self.pseudo_label else answer_text(record.get("answer"))
        return {"texts": [sample["text"] for sample in record["samples"]], "gold": gold}

    def process(self, records: Iterator[dict]) -> Iterator[dict]:
        buffered: list[dict] = []

        def tasks():
            for record in records:
                buffered.append(record)
                yield self._task(record) if record["samples"] else None

        for result in self.pool.map(tasks()):
            record = buffered.pop(0)
            if not record["samples"]:
                self.stats.notes["without samples, passed through"] += 1
                yield record
                continue
            yield self.merge(record, result)

    def merge(self, record: dict, result: Any) -> dict:
        if isinstance(result, (TaskTimeout, TaskFailed)):
            self.stats.notes["verify_error"] += 1
            record.update({key: None for key in SUMMARY_FIELDS}, verify_error=str(result))
            for sample in record["samples"]:
                sample.setdefault("answer", extract_final_answer(sample["text"]))
                sample["correct"] = None
            self._keep_by_mode(record)
            return record
        for sample, answer, correct in zip(record["samples"], result["answers"], result["correct"]):
            sample["answer"] = answer
            sample["correct"] = correct
        for key in SUMMARY_FIELDS:
            record[key] = result[key]
        record["verify_error"] = None
        self._keep_by_mode(record)
        return record

    @staticmethod
    def _keep_by_mode(record: dict) -> None:
        """Also keep the summary under ``verdicts[mode]``, so that a second solve+verify pass in
        another mode (R-Quest: validity, then math) does not erase the first pass's u or s."""
        mode = record.get("mode") or "math"
        verdicts = record.get("verdicts") if isinstance(record.get("verdicts"), dict) else {}
        verdicts[mode] = {key: record.get(key) for key in SUMMARY_FIELDS + ("verify_error",)}
        verdicts[mode]["k"] = len(record["samples"])
        record["verdicts"] = verdicts

    def close(self) -> None:
        self.pool.close()
