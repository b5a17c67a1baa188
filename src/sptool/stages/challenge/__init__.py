"""Question generation: from documents (WIST/SPICE), from nothing (R-Zero/R-Quest), from solutions (SvS).

A package: :mod:`.gamma` (the rule validator Γ), :mod:`.parsing` (every mode's completions),
:mod:`.generating` (the shared stage), and one module per mode: :mod:`.documents`,
:mod:`.questioner`, :mod:`.solutions`.

Three stages share one shape: build chat prompts, sample from a backend, parse each completion,
and emit **every** completion as a question record, valid or not, with ``valid``,
``invalid_reason``, the ``raw`` completion, its token count and the exact prompt (chat messages)
that produced it, so ``filter`` can reward invalid generations and ``train-step`` can score exactly
what was sampled. Nothing generated is dropped silently.

- :class:`DocumentChallengeStage` (WIST §3.4, Eq. 11): G candidate QA pairs per document in JSON
  (``question``, ``correct_answer``, ``answer_type``), checked by the rule validator Γ
  (:func:`gamma_validate`); one ``group_id`` per document.
- :class:`QuestionerStage` (``--from nothing``: the R-Zero / R-Quest questioner): one problem per sample in
  ``<question>…</question>`` plus the questioner's own ``\\boxed{}`` answer
  (:func:`parse_questioner_output`); one ``group_id`` per batch of samples.
- :class:`SolutionChallengeStage` (SvS §3.3, Algorithm 1 lines 11–14): for each correct solution
  of a problem whose accuracy lies in the under-performing band, G_v variant problems that must
  keep the original answer (:func:`parse_variant_output`); one ``group_id`` per solution.
"""

from __future__ import annotations

from sptool.models.base import Backend
from sptool.core.registry import Registry
from sptool.core.stage import Stage
from sptool.stages.challenge.gamma import (  # noqa: F401
    ANSWER_TYPES, MAX_FREE_FORM_ANSWER_CHARS, MAX_FREE_FORM_ANSWER_WORDS, MIN_QUESTION_CHARS,
    MIN_QUESTION_WORDS, MULTIPLE_CHOICE_LETTERS, _DOCUMENT_REFERENCE, gamma_validate,
    option_letters, refers_to_document)
from sptool.stages.challenge.parsing import (  # noqa: F401
    _LATEX_BACKSLASH, _QUESTION_TAG, _balanced_objects, _loads_latex_tolerant, _normalise,
    _strings_in, challenger_fields, check_challenger_output, check_tagged_challenger_output,
    parse_challenger_json, parse_questioner_output, parse_variant_output)
from sptool.stages.challenge.generating import (  # noqa: F401
    _GeneratingStage, _sample_fields, continue_reply)
from sptool.stages.challenge.documents import (  # noqa: F401
    DOCUMENT, DocumentChallengeStage)
from sptool.stages.challenge.questioner import (  # noqa: F401
    QuestionerStage, TOPIC, _TopicKind, topic_of)
from sptool.stages.challenge.solutions import (  # noqa: F401
    SolutionChallengeStage, VERIFIED, _correct_flags_check)

MODES: Registry[type[Stage]] = Registry("challenge mode (--from)", {
    "documents": DocumentChallengeStage, "nothing": QuestionerStage,
    "solutions": SolutionChallengeStage})


def make_challenge_stage(mode: str, backend: Backend, **options) -> Stage:
    """The challenge stage for ``mode`` (documents, nothing, solutions)."""
    return MODES.get(mode)(backend, **options)
