"""Question generation: from documents (WIST/SPICE), from nothing (R-Zero/R-Quest), from solutions (SvS).

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

import dataclasses
import json
import re
from typing import Any, Iterator

from sptool import rewards as R
from sptool.models.base import Backend, Prompt, Sample, SamplingParams
from sptool.prompts import PromptSpec, load_prompt
from sptool.registry import Registry
from sptool.records import (ANSWER, Field, InputError, RecordKind, UsageError, _non_empty,
                            _samples_check, answer_text, content_id, ensure_id, iter_chunks)
from sptool.stage import Stage
from sptool.verify import last_boxed

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
    from sptool.jsonl import loads_strict

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


def check_challenger_output(text: str) -> dict[str, Any]:
    """Parse and validate one Challenger completion → question fields with ``valid``/``invalid_reason``."""
    obj, problem = parse_challenger_json(text)
    if obj is None:
        return {"question": None, "answer": None, "answer_type": None, "valid": False,
                "invalid_reason": problem}
    question, answer, answer_type = challenger_fields(obj)
    valid, reason = gamma_validate(question, answer, answer_type)
    return {"question": question.strip() if isinstance(question, str) else None,
            "answer": answer_text(answer) if isinstance(answer, (str, int, float))
            and not isinstance(answer, bool) else None,
            "answer_type": answer_type if isinstance(answer_type, str) else None,
            "valid": valid, "invalid_reason": reason}


def check_tagged_challenger_output(text: str) -> dict[str, Any]:
    """A Challenger completion in the questioner's tagged format (``<question>…</question>``
    then ``\\boxed{answer}``, the packaged ``documents-short`` prompt) → the same fields as
    :func:`check_challenger_output`, validated by Γ as a free-form answer."""
    question, answer, reason = parse_questioner_output(text)
    if reason is None:
        valid, reason = gamma_validate(question, answer, "free_form")
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


# ---------------------------------------------------------------- shared record building

def _sample_fields(sample: Sample) -> dict[str, Any]:
    fields: dict[str, Any] = {"raw": sample.text, "n_tokens": sample.n_tokens,
                              "finish_reason": sample.finish_reason}
    if sample.logprobs is not None:
        fields["logprobs"] = sample.logprobs
    if sample.stop_string is not None:
        fields["stop_string"] = sample.stop_string
    return fields


class _GeneratingStage(Stage):
    """What the three challenge stages share: backend, sampling params, prompt, batching."""

    role = ""  # the prompt role (sptool.prompts.ROLES)

    def __init__(self, backend: Backend, *, candidates: int = 8, params: SamplingParams | None = None,
                 prompt: str | PromptSpec | None = None, batch_size: int = 4):
        super().__init__()
        if candidates < 1:
            raise UsageError(f"--candidates must be >= 1, got {candidates}")
        if batch_size < 1:
            raise UsageError(f"--prompts-per-call/--group-size must be >= 1, got {batch_size}")
        self.backend = backend
        self.candidates = candidates
        self.prompt = prompt if isinstance(prompt, PromptSpec) else load_prompt(self.role, prompt)
        self.params = self.prompt.sampling(params or SamplingParams())
        self.batch_size = batch_size
        self._calls = 0

    def _generate(self, prompts: list[Prompt], n: int, params: SamplingParams | None = None
                  ) -> list[list[Sample]]:
        """One backend call; the seed moves with the call number so batches differ but reruns match."""
        params = params or self.params
        params = dataclasses.replace(params, seed=self.params.seed * 7919 + self._calls)
        self._calls += 1
        return self.backend.generate(prompts, n, params)

    @property
    def model_id(self) -> str | None:
        return getattr(self.backend, "model_id", None)

    def _count_validity(self, record: dict) -> None:
        if record["valid"]:
            self.stats.notes["valid"] += 1
        else:
            self.stats.notes[f"invalid ({record['invalid_reason']})"] += 1

    def close(self) -> None:
        self.backend.close()

    def _answer_phase(self, prompt: list[dict[str, str]], samples: list[Sample]) -> list[Sample]:
        """Continue every question that stopped with ``answer_prefix`` and generate its answer."""
        spec = self.prompt
        todo = [index for index, sample in enumerate(samples) if sample.finish_reason == "stop"]
        if not todo:
            return samples
        user = [message for message in prompt if message.get("role") != "assistant"]
        continued = [user + [{"role": "assistant", "content": continue_reply(samples[i].text, spec.answer_prefix)}]
                     for i in todo]
        params = dataclasses.replace(self.params, stop=tuple(spec.answer_stop),
                                     max_new_tokens=spec.answer_max_tokens, logprobs=False)
        answers = self._generate(continued, 1, params)
        merged = list(samples)
        for index, outputs in zip(todo, answers):
            first, second = samples[index], outputs[0]
            merged[index] = Sample(text=second.text, n_tokens=first.n_tokens + second.n_tokens,
                                   finish_reason=second.finish_reason, stop_string=second.stop_string)
        return merged


# ---------------------------------------------------------------- --from documents (WIST/SPICE)

DOCUMENT = RecordKind("document", (
    Field("text", (str,), check=_non_empty, help="the cleaned document text (`corpus fetch`)"),
    Field("title", (str,), required=False, nullable=True),
    Field("id", (str, int), required=False, nullable=True),
))


class DocumentChallengeStage(_GeneratingStage):
    """WIST Challenger: G candidate QA pairs per document, all emitted, each judged by Γ."""

    name = "challenge"
    input_kind = DOCUMENT
    role = "challenger"

    def __init__(self, backend: Backend, *, max_document_chars: int = 6000, **options):
        super().__init__(backend, **options)
        self.max_document_chars = max_document_chars

    def prompt_for(self, document: dict) -> list[dict[str, str]]:
        text = document["text"]
        if len(text) > self.max_document_chars:
            text = text[:self.max_document_chars].rsplit(" ", 1)[0] + " …"
        return self.prompt.messages(document, text=text, title=document.get("title") or "(untitled)")

    def process(self, records: Iterator[dict]) -> Iterator[dict]:
        for batch in iter_chunks(records, self.batch_size):
            prompts = [self.prompt_for(document) for document in batch]
            outputs = self._generate(prompts, self.candidates)
            if self.prompt.answer_prefix:  # a tagged, two-phase reply (small models)
                outputs = [self._answer_phase(prompt, samples) for prompt, samples in zip(prompts, outputs)]
            for document, prompt, samples in zip(batch, prompts, outputs):
                doc_id = ensure_id(document, document.get("url"), document["text"])
                group_id = content_id("challenger", doc_id, self.params.seed)
                for index, sample in enumerate(samples):
                    record = {"id": content_id(group_id, index, sample.text), "origin": "challenger",
                              "group_id": group_id, "candidate_index": index,
                              **(check_tagged_challenger_output(sample.text) if self.prompt.answer_prefix
                                 else check_challenger_output(sample.text)),
                              **_sample_fields(sample), "challenger_prompt": prompt,
                              "doc_id": doc_id, "path_id": document.get("path_id"),
                              "leaf": document.get("leaf"), "generator_model": self.model_id}
                    self._count_validity(record)
                    yield record


# ---------------------------------------------------------------- --from nothing (R-Zero/R-Quest)



def topic_of(record: dict) -> str:
    """The topic a seed record names: ``topic``, else ``leaf``, else its ``labels`` joined."""
    for key in ("topic", "leaf"):
        if isinstance(record.get(key), str) and record[key].strip():
            return record[key].strip()
    labels = record.get("labels")
    if isinstance(labels, list) and labels and all(isinstance(label, str) for label in labels):
        return " > ".join(labels)
    raise InputError("missing, expected a string naming the topic (or 'leaf', or 'labels')",
                     field="topic")


class _TopicKind(RecordKind):
    def validate(self, record: Any) -> dict:
        record = super().validate(record)
        topic_of(record)
        return record


TOPIC = _TopicKind("topic", ())


def continue_reply(text: str, continuation: str) -> str:
    """``text`` continued with ``continuation``, without repeating what ``text`` already ends
    with (``"…?</question>"`` + ``"</question>\\n\\boxed{"`` → ``"…?</question>\\n\\boxed{"``)."""
    for overlap in range(min(len(text), len(continuation)), 0, -1):
        if text.endswith(continuation[:overlap]):
            return text + continuation[overlap:]
    return text + continuation


class QuestionerStage(_GeneratingStage):
    """R-Zero/R-Quest questioner: ``candidates`` problems per seed, ``batch_size`` per group.

    With ``unseeded=True`` the input is ignored and one empty seed is used (no topic); otherwise
    every input record is a topic seed. ``answer`` stays null (the solver's majority vote gives
    the pseudo-label); the questioner's own boxed answer is kept as ``questioner_answer``.

    When the prompt has an answer phase (``answer_prefix``, e.g. the packaged ``arithmetic``
    questioner), each reply is generated in two short steps: the question, from the response
    prefix (``<question>``) to a stop string (``?``, ``</question>``); then, for every reply that
    stopped, the same reply continued with ``answer_prefix`` (``</question>\\n\\boxed{``) up to
    ``answer_stop`` (``}``) within ``answer_max_tokens``. ``raw`` is the whole reply; ``n_tokens``
    counts both steps' generated tokens; the sampling log-probs are dropped (the reply holds forced
    text between the two steps).
    """

    name = "challenge"
    input_kind = TOPIC
    role = "questioner"

    def __init__(self, backend: Backend, *, unseeded: bool = True, **options):
        super().__init__(backend, **options)
        self.unseeded = unseeded

    def process(self, records: Iterator[dict]) -> Iterator[dict]:
        seeds: Any = [None] if self.unseeded else records
        for seed_record in seeds:
            topic = topic_of(seed_record) if seed_record is not None else None
            hint = f"\nThe problem must be about: {topic}." if topic else ""
            prompt = self.prompt.messages(seed_record or {}, topic_hint=hint, topic=topic or "")
            remaining, chunk = self.candidates, 0
            while remaining > 0:
                size = min(self.batch_size, remaining)
                samples = self._generate([prompt], size)[0]
                if self.prompt.answer_prefix:
                    samples = self._answer_phase(prompt, samples)
                group_id = content_id("questioner", topic, self.params.seed, chunk)
                for index, sample in enumerate(samples):
                    question, own_answer, reason = parse_questioner_output(sample.text)
                    record = {"id": content_id(group_id, index, sample.text), "question": question,
                              "answer": None, "questioner_answer": own_answer,
                              "origin": "questioner", "group_id": group_id,
                              "valid": reason is None, "invalid_reason": reason,
                              **_sample_fields(sample), "questioner_prompt": prompt,
                              "generator_model": self.model_id}
                    if seed_record is not None:
                        record["topic"] = topic
                        for key in ("path_id", "leaf"):
                            if key in seed_record:
                                record[key] = seed_record[key]
                        if seed_record.get("id") is not None:
                            record["topic_id"] = seed_record["id"]
                    self._count_validity(record)
                    yield record
                remaining -= size
                chunk += 1


# ---------------------------------------------------------------- --from solutions (SvS)

def _correct_flags_check(samples: list) -> str | None:
    problem = _samples_check(samples)
    if problem:
        return problem
    for index, sample in enumerate(samples):
        if "correct" not in sample or not isinstance(sample["correct"], (bool, type(None))):
            return (f"expected every sample to have a boolean 'correct' (run `sptool verify`), "
                    f"item {index} has {json.dumps(sample.get('correct'))}")
    return None


VERIFIED = RecordKind("verified question", (
    Field("question", (str,), check=_non_empty),
    Field("answer", ANSWER.types, help="the original reference answer"),
    Field("samples", (list,), check=_correct_flags_check, help="solutions graded by `sptool verify`"),
    Field("p_hat", (float,), nullable=True, help="accuracy from `sptool verify`"),
))


class SolutionChallengeStage(_GeneratingStage):
    """SvS variational problem synthesis from correct solutions of under-performing problems.

    For a verified problem with Acc(x) = p̂ in the band, each correct solution y_i (at most
    ``max_solutions``, in sample order) prompts ``candidates`` = G_v variants x̂_i^j whose answer
    must equal the original answer a (``answer`` = ``source_answer`` = a, ``parent_id`` = x's id).
    Problems outside the band (or without a correct solution) produce no variants: they are
    dropped with the reason, so ``--rejects`` shows them.
    """

    name = "challenge"
    input_kind = VERIFIED
    role = "synthesis"

    def __init__(self, backend: Backend, *, band: tuple[float, float] = R.SVS_UNDERPERFORMING_BAND,
                 strict_band: bool = False, max_solutions: int = 8, **options):
        super().__init__(backend, **options)
        low, high = band
        if not 0 <= low <= high <= 1:
            raise UsageError(f"--band must be LOW,HIGH with 0 <= LOW <= HIGH <= 1, got {low},{high}")
        if max_solutions < 1:
            raise UsageError(f"--max-solutions must be >= 1, got {max_solutions}")
        self.band, self.strict_band, self.max_solutions = (low, high), strict_band, max_solutions

    def _jobs(self, record: dict) -> list[tuple[dict, int, dict]]:
        p_hat = record.get("p_hat")
        if p_hat is None:
            self.drop(record, "no accuracy (verify_error)")
            return []
        if not R.svs_is_underperforming(float(p_hat), self.band, strict=self.strict_band):
            self.drop(record, "accuracy outside the under-performing band")
            return []
        correct = [(index, sample) for index, sample in enumerate(record["samples"])
                   if sample.get("correct")]
        if not correct:
            self.drop(record, "no correct solution")
            return []
        return [(record, index, sample) for index, sample in correct[:self.max_solutions]]

    def process(self, records: Iterator[dict]) -> Iterator[dict]:
        for batch in iter_chunks(records, self.batch_size):
            jobs = [job for record in batch for job in self._jobs(record)]
            for chunk in iter_chunks(jobs, self.batch_size):
                prompts = [self.prompt.messages(record, solution=sample["text"])
                           for record, _, sample in chunk]
                outputs = self._generate(prompts, self.candidates)
                for (parent, solution_index, _), prompt, samples in zip(chunk, prompts, outputs):
                    answer = answer_text(parent["answer"])
                    parent_id = ensure_id(parent, parent["question"], parent["answer"])
                    group_id = content_id("synthesis", parent_id, solution_index, self.params.seed)
                    for index, sample in enumerate(samples):
                        problem, reason = parse_variant_output(sample.text, parent["question"],
                                                               stopped=sample.stop_string is not None)
                        record = {"id": content_id(group_id, index, sample.text),
                                  "question": problem, "answer": answer, "source_answer": answer,
                                  "origin": "synthesis", "group_id": group_id,
                                  "valid": reason is None, "invalid_reason": reason,
                                  **_sample_fields(sample), "synthesis_prompt": prompt,
                                  "parent_id": parent_id, "source_solution_index": solution_index,
                                  "parent_p_hat": parent["p_hat"], "generator_model": self.model_id}
                        for key in ("path_id", "leaf", "doc_id"):
                            if key in parent:
                                record[key] = parent[key]
                        self._count_validity(record)
                        yield record


NothingChallengeStage = QuestionerStage  # its old name (after the flag value --from nothing)

MODES: Registry[type[Stage]] = Registry("challenge mode (--from)", {
    "documents": DocumentChallengeStage, "nothing": QuestionerStage,
    "solutions": SolutionChallengeStage})


def make_challenge_stage(mode: str, backend: Backend, **options) -> Stage:
    """The challenge stage for ``mode`` (documents, nothing, solutions)."""
    return MODES.get(mode)(backend, **options)
