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

    ``per_call`` (default: one group) is how many sequences one backend call may sample: that many
    whole groups go into a call as copies of the prompt, so a batched backend fills its batch (R-Zero
    at 256 proposals in groups of 4: 1 call instead of 64). The records and their group ids are the
    same; the sampled text differs, as any change of batching does.
    """

    name = "challenge"
    input_kind = TOPIC
    role = "questioner"

    def __init__(self, backend: Backend, *, unseeded: bool = True, per_call: int | None = None, **options):
        super().__init__(backend, **options)
        self.unseeded = unseeded
        # sequences per backend call: whole groups of ``batch_size``, at least one group
        self.groups_per_call = max(1, (per_call or self.batch_size) // self.batch_size)

    def process(self, records: Iterator[dict]) -> Iterator[dict]:
        seeds: Any = [None] if self.unseeded else records
        for seed_record in seeds:
            topic = topic_of(seed_record) if seed_record is not None else None
            hint = f"\nThe problem must be about: {topic}." if topic else ""
            prompt = self.prompt.messages(seed_record or {}, topic_hint=hint, topic=topic or "")
            sizes = [min(self.batch_size, self.candidates - start)
                     for start in range(0, self.candidates, self.batch_size)]
            for first in range(0, len(sizes), self.groups_per_call):
                # several groups in one call: the prompt once per group, the group's size samples each
                groups = self._generate_groups(prompt, sizes[first:first + self.groups_per_call])
                for offset, samples in enumerate(groups):
                    yield from self._records(samples, prompt, topic, seed_record, first + offset)

    def _generate_groups(self, prompt, sizes: list[int]) -> list[list]:
        """The samples of the groups ``sizes``, in order: one backend call (a last, smaller group
        takes a second), then one call for the answer phase of every stopped reply."""
        if len(set(sizes)) == 1:
            groups = self._generate([prompt] * len(sizes), sizes[0])
        else:  # a last, smaller group: its own call
            groups = self._generate([prompt] * (len(sizes) - 1), sizes[0]) + self._generate([prompt], sizes[-1])
        if self.prompt.answer_prefix:
            flat = self._answer_phase(prompt, [sample for group in groups for sample in group])
            groups, start = [], 0
            for size in sizes:
                groups.append(flat[start:start + size])
                start += size
        return groups

    def _records(self, samples, prompt, topic, seed_record, chunk: int) -> Iterator[dict]:
        """The records of one group of replies (one ``group_id``)."""
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
