"""Γ, WIST's rule validator of a generated QA pair (Eq. 11)."""

from __future__ import annotations

import json
import re
from typing import Any

from sptool.core.records import answer_text


ANSWER_TYPES = ("free_form", "multiple_choice")

# ---------------------------------------------------------------- Γ: the rule validator (WIST Eq. 11)

MIN_QUESTION_CHARS = 20
MIN_QUESTION_WORDS = 5
MAX_FREE_FORM_ANSWER_CHARS = 60
MAX_FREE_FORM_ANSWER_WORDS = 8
MULTIPLE_CHOICE_LETTERS = "ABCDEFGHIJ"

# Phrases that make a question depend on a document the solver never sees.
_DOCUMENT_REFERENCE = re.compile(
    r"\b(?:according to|based on|in|from|per|as (?:stated|described|mentioned|given) in)\s+"
    r"(?:the|this|that|above|given)\s+(?:above\s+|given\s+|following\s+)?"
    r"(?:document|text|passage|article|excerpt|paragraph|page|reading|source)s?\b"
    r"|\b(?:the|this)\s+(?:document|passage|article|excerpt)\b"
    r"|\bthe\s+(?:above\s+|given\s+|following\s+)?text\b"
    r"|\b(?:the\s+)?author\s+(?:states?|says|mentions?|claims?)\b",
    re.IGNORECASE)


def refers_to_document(question: str) -> bool:
    """True when the question leans on the hidden document ("according to the text", …)."""
    return bool(_DOCUMENT_REFERENCE.search(question))


def option_letters(question: str) -> set[str]:
    """Option letters laid out in a multiple-choice question: ``A)``, ``(B)``, ``C.``, ``D:``."""
    found = re.findall(r"(?:^|[\s(\[])([A-J])\s*[).:\]]", question)
    return set(found)


def gamma_validate(question: Any, answer: Any, answer_type: Any = "free_form", *,
                   min_question_chars: int = MIN_QUESTION_CHARS,
                   max_answer_chars: int = MAX_FREE_FORM_ANSWER_CHARS) -> tuple[bool, str | None]:
    """WIST's rule-based validator Γ(q, y*) ∈ {0, 1} (Eq. 11): Q(d) = {(q_i, y_i*) | Γ(q_i, y_i*) = 1}.

    Returns ``(valid, reason)``; ``reason`` is None when valid. Rules, checked in order:
    the question is a string of at least ``min_question_chars`` characters and
    ``MIN_QUESTION_WORDS`` words; it does not refer to the hidden document ("the document",
    "the text", "the passage", "according to the article"); ``answer_type`` is ``free_form`` or
    ``multiple_choice``; a free-form answer is non-empty, at most ``max_answer_chars`` characters
    and ``MAX_FREE_FORM_ANSWER_WORDS`` words (short and checkable); a multiple-choice answer is
    one option letter that appears as an option in the question.
    """
    if not isinstance(question, str) or not question.strip():
        return False, "missing question"
    question = question.strip()
    if len(question) < min_question_chars or len(question.split()) < MIN_QUESTION_WORDS:
        return False, "question too short"
    if refers_to_document(question):
        return False, "question refers to the document"
    if answer_type not in ANSWER_TYPES:
        return False, f"unknown answer_type {json.dumps(answer_type)}"
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        return False, "missing answer"
    answer = answer_text(answer) or ""
    if not answer:
        return False, "missing answer"
    if answer_type == "multiple_choice":
        letter = re.fullmatch(r"\(?([A-Ja-j])[).]?", answer)
        if not letter:
            return False, "multiple-choice answer is not an option letter"
        if letter.group(1).upper() not in option_letters(question):
            return False, "multiple-choice answer letter is not an option of the question"
        return True, None
    if len(answer) > max_answer_chars or len(answer.split()) > MAX_FREE_FORM_ANSWER_WORDS:
        return False, "answer too long to check"
    if answer.lower() in ("none", "n/a", "unknown", "...", "?"):
        return False, "answer is a placeholder"
    return True, None
