"""Parsing the completions of every challenge mode: challenger JSON, tagged questions, variants."""

from __future__ import annotations

import re
from typing import Any, Iterator

from sptool.core.records import answer_text
from sptool.stages.verify import last_boxed
from sptool.stages.challenge.gamma import MIN_QUESTION_CHARS, MULTIPLE_CHOICE_LETTERS, gamma_validate, option_letters


# ---------------------------------------------------------------- parsing completions

def _balanced_objects(text: str) -> Iterator[str]:
    """Every balanced ``{…}`` span of ``text`` (string-aware), outermost first."""
    start = text.find("{")
    while start != -1:
        depth, in_string, escaped = 0, False, False
        for position in range(start, len(text)):
            char = text[position]
            if in_string:
                if escaped:
                    escaped = False
                elif char == "\\":
                    escaped = True
                elif char == '"':
                    in_string = False
            elif char == '"':
                in_string = True
            elif char == "{":
                depth += 1
            elif char == "}":
                depth -= 1
                if depth == 0:
                    yield text[start:position + 1]
                    break
        start = text.find("{", start + 1)


_LATEX_BACKSLASH = re.compile(r'(?<!\\)\\(?=[A-Za-z]{2,}|[^\\/"bfnrtu])')


def _strings_in(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings_in(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings_in(item)


def _loads_latex_tolerant(span: str) -> Any:
    """``json.loads`` that survives LaTeX written with single backslashes (``\\frac``, ``\\sqrt``).

    Strict JSON first; when that fails, or silently turns ``\\frac``/``\\boxed`` into a form
    feed/backspace, retry with the backslash of every LaTeX command doubled.
    """
    from sptool.core.jsonl import loads_strict

    try:
        value = loads_strict(span)
        if not any(char in text for text in _strings_in(value) for char in "\f\b"):
            return value
    except ValueError:  # not JSON, or a value no record may hold (digits, nesting, surrogates)
        pass
    try:
        return loads_strict(_LATEX_BACKSLASH.sub(r"\\\\", span))
    except ValueError:
        return None


def parse_challenger_json(text: str) -> tuple[dict | None, str | None]:
    """The first JSON object in a Challenger completion that has a ``question`` key.

    Tolerates code fences and text around the object. Returns ``(object, None)`` or
    ``(None, reason)``.
    """
    saw_object = False
    for span in _balanced_objects(text):
        value = _loads_latex_tolerant(span)
        if value is None:
            continue
        if isinstance(value, dict):
            saw_object = True
            if "question" in value:
                return value, None
    return None, ("JSON object has no 'question'" if saw_object else "no JSON object")


def challenger_fields(obj: dict) -> tuple[Any, Any, Any]:
    """``(question, answer, answer_type)`` from a parsed Challenger object.

    Accepts ``correct_answer`` (the reference format) or ``answer``; ``answer_type`` defaults to
    ``free_form``; an ``options`` list or mapping is appended to the question as ``A) …`` lines.
    """
    question = obj.get("question")
    answer = obj.get("correct_answer", obj.get("answer"))
    answer_type = obj.get("answer_type", "free_form")
    if isinstance(answer_type, str):
        answer_type = answer_type.strip().lower().replace("-", "_").replace(" ", "_")
    options = obj.get("options")
    if isinstance(question, str) and options:
        if isinstance(options, list):
            options = dict(zip(MULTIPLE_CHOICE_LETTERS, options))
        if isinstance(options, dict):
            lines = [f"{str(key).strip('().')}) {value}" for key, value in options.items()]
            if not option_letters(question):
                question = question.rstrip() + "\n" + "\n".join(lines)
    return question, answer, answer_type


def check_challenger_output(text: str, *, min_question_chars: int = MIN_QUESTION_CHARS) -> dict[str, Any]:
    """Parse and validate one Challenger completion → question fields with ``valid``/``invalid_reason``."""
    obj, problem = parse_challenger_json(text)
    if obj is None:
        return {"question": None, "answer": None, "answer_type": None, "valid": False,
                "invalid_reason": problem}
    question, answer, answer_type = challenger_fields(obj)
    valid, reason = gamma_validate(question, answer, answer_type, min_question_chars=min_question_chars)
    return {"question": question.strip() if isinstance(question, str) else None,
            "answer": answer_text(answer) if isinstance(answer, (str, int, float))
            and not isinstance(answer, bool) else None,
            "answer_type": answer_type if isinstance(answer_type, str) else None,
            "valid": valid, "invalid_reason": reason}


def check_tagged_challenger_output(text: str, *, min_question_chars: int = MIN_QUESTION_CHARS) -> dict[str, Any]:
    """A Challenger completion in the questioner's tagged format (``<question>…</question>``
    then ``\\boxed{answer}``, the packaged ``documents-short`` prompt) → the same fields as
    :func:`check_challenger_output`, validated by Γ as a free-form answer."""
    question, answer, reason = parse_questioner_output(text)
    if reason is None:
        valid, reason = gamma_validate(question, answer, "free_form", min_question_chars=min_question_chars)
    else:
        valid = False
    return {"question": question.strip() if isinstance(question, str) else None,
            "answer": answer_text(answer) if isinstance(answer, str) else None,
            "answer_type": "free_form", "valid": valid, "invalid_reason": reason}


_QUESTION_TAG = re.compile(r"<question>(.*?)(?:</question>|$)", re.IGNORECASE | re.DOTALL)


def parse_questioner_output(text: str) -> tuple[str | None, str | None, str | None]:
    """R-Zero questioner format: ``<question>…</question>`` then ``\\boxed{answer}``.

    Returns ``(question, answer, invalid_reason)``; the reason is None when both parts parse.
    The answer is the last ``\\boxed{}`` after the question block (else anywhere in the text).
    An unclosed ``<question>`` (the token budget ran out inside it) is its own reason.
    """
    match = re.search(r"<question>(.*?)</question>", text, re.IGNORECASE | re.DOTALL)
    if not match:
        if re.search(r"<question>", text, re.IGNORECASE):
            return None, last_boxed(text), "unclosed <question> (no </question> within the token budget)"
        return None, last_boxed(text), "no <question> tag"
    question = match.group(1).strip()
    answer = last_boxed(text[match.end():]) or last_boxed(question)
    if not question:
        return None, answer, "empty question"
    if answer is None:
        return question, None, "no boxed answer"
    return question, answer, None


def parse_variant_output(text: str, original_question: str | None = None, *,
                         stopped: bool = False) -> tuple[str | None, str | None]:
    """SvS variant problem in ``<problem>…</problem>`` → ``(problem, invalid_reason)``.

    ``stopped``: generation ended at a stop string (the ``solutions-short`` prompt starts the
    reply inside ``<problem>`` and stops at the question mark), so an unclosed ``<problem>``
    holds the whole problem."""
    match = re.search(r"<problem>(.*?)</problem>", text, re.IGNORECASE | re.DOTALL)
    if not match and stopped:
        match = re.search(r"<problem>(.*)", text, re.IGNORECASE | re.DOTALL)
    if not match:
        if re.search(r"<problem>", text, re.IGNORECASE):
            return None, "unclosed <problem> (no </problem> within the token budget)"
        return None, "no problem extracted"
    problem = match.group(1).strip()
    if not problem:
        return None, "empty problem"
    if original_question and _normalise(problem) == _normalise(original_question):
        return problem, "copies the original problem"
    return problem, None


def _normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()
