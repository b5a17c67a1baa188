"""``challenge --from documents`` (WIST §3.4, SPICE): G candidate QA pairs per document."""

from __future__ import annotations

from typing import Iterator

from sptool.models.base import Backend
from sptool.prompts import MAX_DOCUMENT_CHARS
from sptool.core.records import Field, RecordKind, _non_empty, content_id, ensure_id, iter_chunks
from sptool.stages.challenge.gamma import MIN_QUESTION_CHARS
from sptool.stages.challenge.parsing import check_challenger_output, check_tagged_challenger_output
from sptool.stages.challenge.generating import _GeneratingStage, _sample_fields


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

    def __init__(self, backend: Backend, *, max_document_chars: int = MAX_DOCUMENT_CHARS,
                 min_question_chars: int = MIN_QUESTION_CHARS, **options):
        super().__init__(backend, **options)
        self.max_document_chars, self.min_question_chars = max_document_chars, min_question_chars

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
                              **(check_tagged_challenger_output(sample.text, min_question_chars=self.min_question_chars)
                                 if self.prompt.answer_prefix
                                 else check_challenger_output(sample.text, min_question_chars=self.min_question_chars)),
                              **_sample_fields(sample), "challenger_prompt": prompt,
                              "doc_id": doc_id, "path_id": document.get("path_id"),
                              "leaf": document.get("leaf"), "generator_model": self.model_id}
                    self._count_validity(record)
                    yield record
