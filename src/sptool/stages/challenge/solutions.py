"""``challenge --from solutions`` (SvS §3.3): variants that keep the original answer."""

from __future__ import annotations

import json
from typing import Iterator

from sptool import rewards as R
from sptool.models.base import Backend
from sptool.core.records import (ANSWER, Field, RecordKind, UsageError, _non_empty, _samples_check, answer_text,
                            content_id, ensure_id, iter_chunks)
from sptool.stages.challenge.parsing import parse_variant_output
from sptool.stages.challenge.generating import _GeneratingStage, _sample_fields


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
