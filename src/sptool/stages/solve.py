"""``solve``: K sampled solutions per question from a generation backend.

Two modes: ``math`` (reason step by step, final answer in ``\\boxed{}``) and ``validity``
(R-Quest: the solver may answer ``\\boxed{INVALID}`` when the problem is flawed), each with its
prompt role (``solve``, ``validity``): a packaged prompt (``math``, ``direct`` …) or a template
file, with its response prefix and stop strings (:mod:`sptool.prompts`). Questions are batched:
one backend call generates K samples for each of ``batch_size`` questions.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator

from sptool.models.base import Backend, SamplingParams
from sptool.prompts import PromptSpec, fill_template, load_prompt
from sptool.core.records import QUESTION, UsageError, ensure_id, iter_chunks
from sptool.core.stage import Stage
from sptool.stages.verify import extract_final_answer

MODES = {"math": "solve", "validity": "validity"}  # mode -> prompt role


def solve_prompt(template: str, record: dict) -> list[dict[str, str]]:
    """The chat messages for one question (the user message is the filled template)."""
    return [{"role": "user", "content": fill_template(template, record)}]


class SolveStage(Stage):
    """Adds ``samples: [{text, answer, n_tokens, finish_reason, logprobs?}]``, ``mode`` and
    ``solve_prompt`` (the exact chat messages, which ``train-step`` reuses) to each question."""

    name = "solve"
    input_kind = QUESTION

    def __init__(self, backend: Backend, *, samples: int = 8, mode: str = "math",
                 params: SamplingParams | None = None, prompt: str | PromptSpec | None = None,
                 batch_size: int = 16, skip_invalid_questions: bool = True,
                 deadline: float | None = None):
        super().__init__()
        if mode not in MODES:
            raise UsageError(f"unknown --mode '{mode}'; choose from {', '.join(MODES)}")
        if samples < 1:
            raise UsageError(f"-k/--samples must be >= 1, got {samples}")
        self.backend = backend
        self.samples = samples
        self.mode = mode
        self.prompt = prompt if isinstance(prompt, PromptSpec) else load_prompt(MODES[mode], prompt)
        self.params = self.prompt.sampling(params or SamplingParams())
        self.batch_size = max(1, batch_size)
        self.skip_invalid_questions = skip_invalid_questions
        self.deadline = deadline  # time.monotonic() by which solving must end; None: no limit
        self.deadline_reached = False

    def process(self, records: Iterator[dict]) -> Iterator[dict]:
        for batch_number, batch in enumerate(iter_chunks(records, self.batch_size)):
            todo = []
            for record in batch:
                if self.skip_invalid_questions and record.get("valid") is False:
                    continue  # generated questions already judged invalid: pass through unsolved
                todo.append(record)
            if todo and self.deadline is not None and time.monotonic() >= self.deadline:
                self.deadline_reached = True
            if todo and self.deadline_reached:  # every later question is dropped, counted
                for record in batch:
                    self.drop(record, "deadline")
                continue
            if todo:
                prompts = [self.prompt.messages(record) for record in todo]
                params = dataclasses.replace(self.params, seed=self.params.seed * 7919 + batch_number,
                                             deadline=self.deadline)
                outputs = self.backend.generate(prompts, self.samples, params)
                if self.deadline is not None and (time.monotonic() >= self.deadline or any(
                        len(samples) < self.samples for samples in outputs)):
                    self.deadline_reached = True  # generation was cut: the batch is incomplete
                    for record in batch:
                        self.drop(record, "deadline")
                    continue
                for record, prompt, samples in zip(todo, prompts, outputs):
                    ensure_id(record, record["question"], record.get("answer"))
                    record["mode"] = self.mode
                    record["solve_prompt"] = prompt
                    record["samples"] = []
                    for sample in samples:
                        entry = sample.to_record()
                        entry["answer"] = extract_final_answer(sample.text)
                        record["samples"].append(entry)
                    record["solver_model"] = getattr(self.backend, "model_id", None)
            for record in batch:
                if "samples" not in record or record.get("mode") != self.mode:
                    self.stats.notes["passed through unsolved (valid=false)"] += 1
                    record.setdefault("samples", [])
                yield record
