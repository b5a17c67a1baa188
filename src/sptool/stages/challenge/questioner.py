"""``challenge --from nothing`` (R-Zero, R-Quest): the questioner writes problems from nothing."""

from __future__ import annotations

from typing import Any, Iterator

from sptool.models.base import Backend
from sptool.core.records import InputError, RecordKind, content_id
from sptool.stages.challenge.parsing import parse_questioner_output
from sptool.stages.challenge.generating import _GeneratingStage, _sample_fields


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
