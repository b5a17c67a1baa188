"""Answer extraction, equivalence (math-verify) and majority vote, in killable worker processes.

For each solved question with samples ``y_1..y_K``:

- the final answer of each sample is the content of its last ``\\boxed{…}``; ``INVALID`` there
  (R-Quest's validity mode) counts towards ``invalid_frac`` u = #INVALID / K;
- a sample without a boxed answer falls back to math-verify's own extraction from the whole text
  ("The final answer is $6$.", "Answer: \\( \\frac{1}{2} \\)", a last number …), so grading is at
  least as lenient as math-verify; such a sample has ``boxed: false`` (the format term of the
  rewards still asks for ``\\boxed{}``), and ``require_boxed`` turns the fallback off;
- correctness uses math-verify with the gold answer first (``verify(gold, pred)``; it is not
  symmetric);
- answers are grouped into equivalence classes by math-verify (not string equality); the
  largest class is the ``majority`` and ``majority_frac`` s = |class| / K (R-Zero's p, R-Quest's s);
- with no reference answer (pseudo-label mode) a sample is correct when it is in the majority
  class;
- a reasoning-gym record whose task is not mathematical (``grader: "reasoning-gym"``, from
  ``sptool data gym``) is graded by the task's own scorer instead (answers grouped by equal text);
- p̂ = mean correctness, Var = p̂ (1 − p̂) (WIST's learnability signal).

Model text is only ever parsed (latex2sympy), never evaluated as code.
"""

from __future__ import annotations

import functools
import re
from decimal import Decimal
from typing import Any, Iterator, NamedTuple

from sptool.core.records import SOLVED, answer_text
from sptool.rewards import empirical_accuracy, empirical_variance
from sptool.core.stage import Stage
from sptool.core.workers import DeadlinePool, TaskFailed, TaskTimeout

INVALID = "INVALID"
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACES = re.compile(r"[{}]")


def _closed_boxes(text: str) -> list[tuple[int, int, int]]:
    """Every ``\\boxed{…}`` whose braces close: (start of ``\\boxed``, start of content, position
    of the closing brace), in order of appearance.

    One pass over the braces (linear time): a text of thousands of nested or unclosed
    ``\\boxed{`` cannot stall the caller (the parent process extracts too, outside any deadline).
    """
    matches = list(_BOXED.finditer(text))
    if not matches:
        return []
    openings = {match.end() - 1 for match in matches}
    closing: dict[int, int] = {}
    stack: list[int] = []
    for brace in _BRACES.finditer(text):
        position = brace.start()
        if text[position] == "{":
            stack.append(position)
        elif stack:
            opened = stack.pop()
            if opened in openings:
                closing[opened] = position
    return [(match.start(), match.end(), closing[match.end() - 1]) for match in matches
            if match.end() - 1 in closing]


def last_boxed(text: str, closed: list[tuple[int, int, int]] | None = None) -> str | None:
    """Content of the last ``\\boxed{…}`` in ``text`` (balanced braces), or None."""
    boxes = _closed_boxes(text) if closed is None else closed
    if not boxes:
        return None
    _, start, end = boxes[-1]
    return text[start:end].strip() or None


def _boxes(text: str, closed: list[tuple[int, int, int]] | None = None) -> list[tuple[int, int, str]]:
    """The outermost ``\\boxed{…}`` of ``text``: (start, end, stripped content), in order."""
    boxes: list[tuple[int, int, str]] = []
    for box_start, start, end in (_closed_boxes(text) if closed is None else closed):
        if boxes and box_start < boxes[-1][1]:
            continue  # nested in the previous box
        boxes.append((box_start, end + 1, text[start:end].strip()))
    return boxes


# What may stand between boxed answers that together are one answer ("\boxed{-2} and \boxed{1}").
_BOX_JOINER = re.compile(r"(?:\s|[,;~]|\$|\\[,;:!]|\\q?quad|\\text\{\s*(?:and|or)\s*\}|\band\b|\bor\b"
                         r"|\\[\[\]()])*")
# A final-answer statement after the last box outranks it, as in math-verify's own extraction.
_FINAL_ANSWER_AFTER = re.compile(r"final answer\W{0,3}\s*(?:the final answer\s*)?is\b", re.IGNORECASE)


def _final_boxed(text: str) -> tuple[str | None, int]:
    """The last boxed answer (adjacent boxes joined as a list) and where it ends in ``text``."""
    closed = _closed_boxes(text)
    boxes = _boxes(text, closed)
    if not boxes:
        return None, len(text)
    group = [boxes[-1]]
    for box in reversed(boxes[:-1]):
        if not _BOX_JOINER.fullmatch(text, box[1], group[0][0]):
            break
        group.insert(0, box)
    contents = list(dict.fromkeys(content for _, _, content in group if content))
    if len(contents) <= 1:
        return last_boxed(text, closed), boxes[-1][1]
    return ", ".join(contents), boxes[-1][1]


def extract_final_answer(text: str) -> str | None:
    """The sample's final answer: the last boxed content (boxes side by side, as in
    "\\boxed{-2} and \\boxed{1}", joined into one list); ``INVALID`` normalised."""
    return _invalid_normalised(_final_boxed(text)[0])


def _invalid_normalised(answer: str | None) -> str | None:
    if answer is not None and re.fullmatch(r"(\\text\{)?\s*invalid\s*\}?", answer, flags=re.IGNORECASE):
        return INVALID
    return answer


# ---------------------------------------------------------------- worker side (pure functions)

class FinalAnswer(NamedTuple):
    """One sample's final answer as graded.

    ``text`` is what the record stores as the sample's ``answer``; ``boxed`` says whether it came
    from ``\\boxed{}`` (else from math-verify's extraction); ``key`` identifies it in the
    equivalence cache; ``parsed`` is math-verify's parse when extraction already made it.
    """

    text: str
    boxed: bool
    key: tuple
    parsed: Any = None


def boxed_answer(text: str) -> FinalAnswer:
    """A boxed (or reference) answer string, parsed lazily."""
    return FinalAnswer(text, True, ("boxed", text))


@functools.lru_cache(maxsize=65536)
def parse_answer(answer: str):
    """math-verify's parse of a final answer (cached; runs inside a worker process)."""
    from math_verify import parse

    parsed = parse("\\boxed{" + answer + "}", parsing_timeout=5)
    if not parsed:
        parsed = parse(answer, parsing_timeout=5)
    return parsed


@functools.lru_cache(maxsize=4096)
def parse_completion(text: str):
    """math-verify's own extraction from a whole completion (its default LaTeX and expression
    targets: "final answer is", the last ``$…$``, ``\\[…\\]``, a last number …)."""
    from math_verify import parse

    return parse(text, parsing_timeout=5)


def final_answer(text: str, *, require_boxed: bool = False) -> FinalAnswer | None:
    """The sample's final answer: its last ``\\boxed{}`` (``INVALID`` normalised), else, unless
    ``require_boxed``, what math-verify's extraction finds in the text; None when neither.

    Unless ``require_boxed``, a "final answer is …" statement after the last box outranks the
    box (models that box intermediate results, then state the answer), as in math-verify."""
    answer, end = _final_boxed(text)
    answer = _invalid_normalised(answer)
    if require_boxed:
        return None if answer is None else boxed_answer(answer)
    if answer is not None:
        tail = text[end:]
        if not _FINAL_ANSWER_AFTER.search(tail):
            return boxed_answer(answer)
        text = tail  # "… \\boxed{200} … The final answer is $10,455$.": the statement wins
    parsed = parse_completion(text)
    if not parsed:
        return None if answer is None else boxed_answer(answer)
    shown = str(parsed[-1]).strip() or str(parsed[0])
    stated = FinalAnswer(shown, False, ("extracted", shown, str(parsed[0])), parsed)
    if answer is not None and answer != INVALID and equivalent(boxed_answer(answer), stated):
        return boxed_answer(answer)  # "\\boxed{5}. So the final answer is 5.": boxed all the same
    return stated


# A final answer that is plain arithmetic on numbers (two or more numbers joined by +, −, ×, ÷, *,
# nothing else: no variable, power, root or fraction) has not been evaluated: "\\boxed{47+38}" for
# "What is 47 + 38?" restates the question. math-verify simplifies it to 85 and calls it correct, so
# an RL policy learns to copy the question into the box (measured on two-digit sums: sampled
# "accuracy" 0.99 after 14 steps, 0.00 held-out under a grader that wants the number). Such an
# answer is wrong, and casts no vote. "47 + 38 = 85" is fine: the part after the last "=" counts.
_NUMBER = r"\(?[-+−]?\d+(?:,\d{3})*(?:\.\d+)?\)?"  # "1,000": a thousands separator; "1, -2": two answers
_OPERATOR = r"(?:[-+*×÷−]|\\times|\\cdot|\\div|\\ast)"
_UNEVALUATED = re.compile(rf"{_NUMBER}(?:{_OPERATOR}{_NUMBER})+")
_UNEVALUATED_MAX_CHARS = 256  # longer answers go to math-verify (and its deadline) as before


def _squeezed(text: str) -> str:
    return re.sub(r"\s+|\$|\\[,!;]", "", text)


def unevaluated_arithmetic(answer: str) -> bool:
    """Is ``answer`` (after its last "=") arithmetic on numbers left unevaluated ("47 + 38")?"""
    final = answer.rsplit("=", 1)[-1]
    if len(final) > _UNEVALUATED_MAX_CHARS:
        return False
    return bool(_UNEVALUATED.fullmatch(_squeezed(final)))


# An equation on numbers ("47 + 38 = 85") is graded by its value, the part after the last "=".
# math-verify compares two equations by lhs − rhs, so every true equation equals every other
# ("47 + 38 = 85" ≡ "57 + 76 = 133", both 0), and so does every pair off by the same amount. When
# a majority answer is such an equation it becomes a pseudo-label that any true equation matches:
# on two-digit sums the random-label control then learnt to box true equations and reached 0.82
# "accuracy" against labels of other questions. Equations with a variable ("x = 5", "y = 2x + 1")
# are left to math-verify.
_NUMERIC_SIDE = re.compile(rf"{_NUMBER}(?:{_OPERATOR}{_NUMBER})*")


def settled_answer(final: FinalAnswer | None) -> FinalAnswer | None:
    """The answer as graded: None for no answer or unevaluated arithmetic ("47+38"); the value of an
    equation on numbers ("47 + 38 = 85" → "85"); else the answer itself."""
    if final is None or unevaluated_arithmetic(final.text):
        return None
    *sides, value = final.text.split("=")
    value = value.strip().rstrip(".").strip()
    if sides and value and len(final.text) <= _UNEVALUATED_MAX_CHARS and all(
            _NUMERIC_SIDE.fullmatch(_squeezed(side)) for side in sides):
        return boxed_answer(value)
    return final


_EQUIVALENT: dict[tuple, bool] = {}
_EQUIVALENT_MAX = 262144


# A plain number: an integer ("85", "-7", "007"), or a decimal of at most 6 places and 12 digits
# ("431.2", "-0.125"). Two of them are equivalent exactly when their values are equal, which is
# math-verify's verdict too (checked on 8,000 pairs: signs, leading zeros, trailing zeros, 30-digit
# integers, decimals 10^-6 apart), without its parse and sympy. math-verify rounds to 6 places, so
# longer decimals ("0.3333333" is "0.333333" there) go to it as before. Most answers of arithmetic
# tasks are plain numbers, and the majority vote compares them pairwise: one grading of a real
# step's 64 x 8 two-digit sums spent 0.6 s in math-verify's parse and sympy (CPU, cold caches).
_PLAIN_INTEGER = re.compile(r"\s*[+-]?\d{1,64}\s*")
_PLAIN_DECIMAL = re.compile(r"\s*[+-]?\d+\.\d{1,6}\s*")


def _plain_value(answer: FinalAnswer) -> Decimal | None:
    text = answer.text
    if not answer.boxed or len(text) > 80:
        return None
    if _PLAIN_INTEGER.fullmatch(text) or (_PLAIN_DECIMAL.fullmatch(text) and sum(c.isdigit() for c in text) <= 12):
        return Decimal(text.strip())
    return None


def _one_parse(parsed) -> tuple[Any, str] | None:
    """A math-verify parse of one expression (``[expression, "its text"]``): the expression and the
    stripped text; else None."""
    if isinstance(parsed, list) and len(parsed) == 2 and isinstance(parsed[1], str):
        return parsed[0], parsed[1].strip()
    return None


def _exact_number(parsed) -> tuple[Any, str] | None:
    """A math-verify parse that is one rational number and its text (``[Integer(85), "85"]``,
    ``[Rational(1, 2), "\\frac{1}{2}"]``): the number and the stripped text; else None."""
    one = _one_parse(parsed)
    return one if one is not None and getattr(one[0], "is_Rational", False) is True else None


def _exact_numbers_verdict(gold_parsed, predicted_parsed) -> bool | None:
    """math-verify's verdict on two parses that are each one rational number, without its sympy
    path; None for any other pair.

    ``verify`` tries every pair of the two lists. Number against number: equal ``==`` is True, a
    rational is no float (no rounding) and no percentage, and ``simplify(a - b)`` of two unequal
    rationals is not zero, so the verdict is ``a == b``. Number against text is False. Text against
    text: equal non-empty stripped texts. A step's ungraded completions ("25 + 50 = 105") are mostly
    such numbers, and a question's majority vote compares them pairwise, both ways: one grading of
    256 samples of the tiny model spent 0.84 s of 1.37 in ``verify``'s ``simplify``."""
    gold_number, predicted_number = _exact_number(gold_parsed), _exact_number(predicted_parsed)
    if gold_number is None or predicted_number is None:
        return None
    (gold_value, gold_text), (predicted_value, predicted_text) = gold_number, predicted_number
    return bool(gold_value == predicted_value) or (bool(gold_text) and gold_text == predicted_text)


def _letters_polynomial(expression) -> bool:
    """Is ``expression`` a polynomial of positive degree in its letters, with numbers, e and π for
    coefficients? latex2sympy reads a word as the product of its letters ("answer" is
    ``E*a*n*r*s*w``), so the garbage a policy boxes ("Tin + TwiceTint", "6\\cdot L", "233f") is such
    a polynomial."""
    from sympy import Add, E, Mul, Poly, Pow, pi, preorder_traversal

    if not isinstance(expression, (Add, Mul, Pow)) or not expression.free_symbols:
        return False
    for node in preorder_traversal(expression):
        if isinstance(node, (Add, Mul)) or node.is_Symbol or node in (E, pi) or (node.is_Number and node.is_finite):
            continue
        if isinstance(node, Pow) and node.exp.is_Integer and node.exp > 0:
            continue
        return False
    try:
        return Poly(expression, *sorted(expression.free_symbols, key=str)).total_degree() > 0
    except Exception:  # noqa: BLE001 - not a polynomial sympy can write: left to verify
        return False


def _number_against_non_number_verdict(gold_parsed, predicted_parsed) -> bool | None:
    """math-verify's verdict on a finite number against a polynomial in letters, or a rational
    number against a set of two or more rationals ("576, 721"), without its sympy path; None for
    any other pair.

    The number is no polynomial of positive degree (``simplify(a - b)`` is not zero, no float
    rounding applies to a symbolic side, no relation, set or single symbol is involved), and a
    singleton is no set of two distinct rationals (unequal, a non-empty symmetric difference, unequal
    lengths). What is left of ``verify``'s pairs is the two texts: equal and non-empty. A policy's
    boxed garbage meets every number of its question's majority vote so, both ways, at 15-45 ms a
    pair (sympy's ``simplify`` and set comparisons): grading an H100 loop run's kept records took
    less than half the time without them (this repository's CPU, one process)."""
    from sympy import FiniteSet

    gold, predicted = _one_parse(gold_parsed), _one_parse(predicted_parsed)
    if gold is None or predicted is None:
        return None
    for (number, _), (other, _) in ((gold, predicted), (predicted, gold)):
        if getattr(number, "is_Number", False) is not True or not number.is_finite:
            continue
        if _letters_polynomial(other) or (
                number.is_Rational and isinstance(other, FiniteSet) and len(other) >= 2
                and all(getattr(element, "is_Rational", False) is True for element in other)):
            return bool(gold[1]) and gold[1] == predicted[1]
    return None


def equivalent(gold: FinalAnswer, predicted: FinalAnswer) -> bool:
    """math-verify equivalence, gold first (cached on the pair of answer keys; two plain numbers by
    their values, two parses that are rational numbers by :func:`_exact_numbers_verdict`, a number
    against letters or a set of rationals by :func:`_number_against_non_number_verdict`)."""
    if gold.key == predicted.key:
        return True
    gold_value, predicted_value = _plain_value(gold), _plain_value(predicted)
    if gold_value is not None and predicted_value is not None:
        return gold_value == predicted_value
    pair = (gold.key, predicted.key)
    verdict = _EQUIVALENT.get(pair)
    if verdict is None:
        from math_verify import verify

        gold_parsed = gold.parsed if gold.parsed is not None else parse_answer(gold.text)
        predicted_parsed = predicted.parsed if predicted.parsed is not None else parse_answer(predicted.text)
        verdict = False
        if gold_parsed and predicted_parsed:
            verdict = _exact_numbers_verdict(gold_parsed, predicted_parsed)
            if verdict is None:
                verdict = _number_against_non_number_verdict(gold_parsed, predicted_parsed)
            if verdict is None:
                verdict = bool(verify(gold_parsed, predicted_parsed, timeout_seconds=5))
        if len(_EQUIVALENT) >= _EQUIVALENT_MAX:
            _EQUIVALENT.clear()
        _EQUIVALENT[pair] = verdict
    return verdict


def answers_equivalent(gold: str, predicted: str) -> bool:
    """math-verify equivalence of two answer strings as graded (:func:`settled_answer`), gold first
    (cached)."""
    gold_settled, predicted_settled = settled_answer(boxed_answer(gold)), settled_answer(boxed_answer(predicted))
    return bool(gold_settled and predicted_settled) and equivalent(gold_settled, predicted_settled)


def majority_classes(answers: list) -> list[list[int]]:
    """Equivalence classes (indices into ``answers``) of the non-empty, non-INVALID answers
    (strings or :class:`FinalAnswer`).

    Each answer joins the first class whose representative it is equivalent to (checked both
    ways, since math-verify is not symmetric); classes are returned largest first, ties by first
    occurrence.
    """
    items = [boxed_answer(a) if isinstance(a, str) else a for a in answers]
    classes: list[list[int]] = []
    for index, answer in enumerate(items):
        if answer is None or answer.text == INVALID:
            continue
        for members in classes:
            representative = items[members[0]]
            if equivalent(representative, answer) or equivalent(answer, representative):
                members.append(index)
                break
        else:
            classes.append([index])
    return sorted(classes, key=lambda members: (-len(members), members[0]))


def warm_up() -> None:
    """Import math-verify (and sympy) and exercise it once, before any deadline starts; ``x^2``
    against ``2x`` runs sympy's ``simplify``, whose first call imports ``sympy.physics.units``
    (0.3 s, or it lands in the first grading)."""
    answers_equivalent("1", "1.0")
    answers_equivalent("x^2", "2x")
    parse_completion("The final answer is $1$.")


def _task_scorer_answers(texts: list[str], scorer: dict, require_boxed: bool):
    """Answers, boxed flags, classes and a correctness test for a task graded by its own scorer
    (reasoning-gym): the answer is the boxed text (else an answer tag or stated answer), classes
    are equal answers up to case and spacing, correct means the task's score is 1."""
    from sptool.gym import normalised_plain, plain_answer, task_score

    answers: list[str | None] = []
    boxed: list[bool] = []
    for text in texts:
        box = extract_final_answer(text)
        answers.append(INVALID if box == INVALID else plain_answer(text, box, require_boxed=require_boxed))
        boxed.append(box is not None)
    by_key: dict[str, list[int]] = {}
    for index, answer in enumerate(answers):
        if answer is not None and answer != INVALID:
            by_key.setdefault(normalised_plain(answer), []).append(index)
    classes = sorted(by_key.values(), key=lambda members: (-len(members), members[0]))

    def is_correct(index: int) -> bool:
        answer = answers[index]
        return answer is not None and answer != INVALID and task_score(
            scorer["task"], scorer.get("config") or {}, scorer["entry"], answer) >= 1.0

    return answers, boxed, classes, is_correct


def grade(task: dict) -> dict:
    """Grade one solved question: ``{"texts": [...], "gold": str|None, "require_boxed": bool,
    "vote": bool}`` → verdict fields.

    ``vote`` (default true): also take the majority vote when a reference answer grades the
    samples. Without a reference the vote is the label and is always taken. Beside a reference it
    is only a statistic (``majority``, ``majority_frac``, ``n_classes``; null when not taken), and
    its O(k²) pairwise math-verify comparisons between wrong answers are most of the grading time
    (an rlvr loop's step on an H100, 64 questions × 8 samples: 1.72 s in one process with the vote,
    0.55 s without)."""
    texts: list[str] = task["texts"]
    gold: str | None = task["gold"]
    k = len(texts)
    require_boxed = task.get("require_boxed", False)
    vote = gold is None or task.get("vote", True)
    if task.get("scorer"):  # a reasoning-gym task that is not graded by math-verify
        answers, boxed, classes, is_correct = _task_scorer_answers(texts, task["scorer"], require_boxed)
        graded = answers
        if not vote:
            classes = None
    else:
        finals = [final_answer(text, require_boxed=require_boxed) for text in texts]
        answers = [final.text if final else None for final in finals]
        boxed = [bool(final and final.boxed) for final in finals]
        settled = [settled_answer(final) for final in finals]
        graded = [final.text if final else None for final in settled]  # the majority: "85", not "47 + 38 = 85"
        classes = majority_classes(settled) if vote else None
        reference = settled_answer(boxed_answer(gold)) if gold is not None else None

        def is_correct(index: int) -> bool:
            final = settled[index]
            return final is not None and final.text != INVALID and reference is not None and \
                equivalent(reference, final)

    majority_members = set(classes[0]) if classes else set()
    majority = graded[classes[0][0]] if classes else None
    majority_frac = None if classes is None else len(majority_members) / k if k else 0.0
    if gold is not None:
        correct = [is_correct(index) for index in range(k)]
        label_source = "reference"
    else:
        correct = [index in majority_members for index in range(k)]
        label_source = "majority"
    p_hat = empirical_accuracy(correct)
    return {
        "answers": answers,
        "boxed": boxed,
        "correct": correct,
        "p_hat": p_hat,
        "var": empirical_variance(p_hat),
        "majority": majority,
        "majority_frac": majority_frac,
        "invalid_frac": sum(a == INVALID for a in answers) / k if k else 0.0,
        "n_classes": None if classes is None else len(classes),
        "label_source": label_source,
    }


# ---------------------------------------------------------------- the stage

#: when the majority vote is taken: every question, or only where it makes the label
VOTES = ("always", "auto")
SUMMARY_FIELDS = ("p_hat", "var", "majority", "majority_frac", "invalid_frac", "n_classes",
                  "label_source")

class VerifyStage(Stage):
    """Adds per-sample ``answer``/``boxed``/``correct`` and ``p_hat``, ``var``, ``majority``,
    ``majority_frac``, ``invalid_frac`` to each solved question.

    ``require_boxed``: only ``\\boxed{}`` answers count (no fallback to math-verify's extraction).

    ``vote``: ``always`` takes the majority vote of every question; ``auto`` only where it makes
    the label (``pseudo_label``, or a question without a reference answer). Beside a reference the
    vote is a statistic whose pairwise comparisons cost most of the grading; under ``auto`` its
    fields (``majority``, ``majority_frac``, ``n_classes``) are null there.

    A question whose grading overruns ``deadline_s`` is emitted with ``verify_error`` (and null
    statistics) instead of hanging the stage.
    """

    name = "verify"
    input_kind = SOLVED

    def __init__(self, *, workers: int = 2, deadline_s: float = 30.0, pseudo_label: bool = False,
                 require_boxed: bool = False, vote: str = "always"):
        super().__init__()
        if vote not in VOTES:
            raise ValueError(f"vote: expected one of {', '.join(VOTES)}, got {vote!r}")
        self.vote = vote
        self.pool = DeadlinePool(grade, workers=workers, deadline_s=deadline_s, warmup=warm_up)
        self.pseudo_label = pseudo_label
        self.require_boxed = require_boxed

    def _task(self, record: dict) -> dict:
        gold = None if self.pseudo_label else answer_text(record.get("answer"))
        task = {"texts": [sample["text"] for sample in record["samples"]], "gold": gold,
                "require_boxed": self.require_boxed, "vote": self.vote == "always"}
        if record.get("grader") == "reasoning-gym" and isinstance(record.get("task"), str):
            gym = record.get("gym") if isinstance(record.get("gym"), dict) else {}
            task["scorer"] = {"task": record["task"], "config": gym.get("config") or {},
                              "entry": {"question": record["question"], "answer": record.get("answer"),
                                        "metadata": record.get("metadata") or {}}}
        return task

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
                sample["boxed"] = last_boxed(sample["text"]) is not None
                sample["correct"] = None
            self._keep_by_mode(record)
            return record
        for sample, answer, boxed, correct in zip(record["samples"], result["answers"], result["boxed"],
                                                  result["correct"]):
            sample["answer"] = answer
            sample["boxed"] = boxed
            sample["correct"] = correct
            if answer is not None and not boxed:
                self.stats.notes["answers found without \\boxed{} (math-verify extraction)"] += 1
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
