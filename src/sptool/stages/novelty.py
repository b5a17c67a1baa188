"""R-Quest's novelty gate: sampled pairwise same-task judgements by a frozen model.

For each candidate q in a batch of B, draw K other candidates of the batch without replacement
and ask a frozen judge (by default the base model) whether the two are the same mathematical
task type: the same setting and asked quantity (changed numbers or wording are the same type;
belonging to the same broad area is not). Any "same" verdict makes q not novel:

    g_novel(q) = 1  if no sampled partner is judged the same task type, else 0.

This costs B·K judgements instead of the O(B²) of comparing all pairs; a type that makes up a
share p of the batch passes with probability about (1 − p)^K (:func:`novelty_pass_probability`).
Judgements use greedy decoding and are batched through the backend. A verdict that cannot be
parsed counts as "not same" and is recorded as ``unparsed``.

:class:`LexicalJudge` is a judge without a model, for models too small to judge (the 135M tiny
model answers the same word for every pair: its YES−NO log-odds were 0.75–1.63 on same-type and
on unrelated pairs alike): two problems are the same type when their texts, every number
replaced by ``#``, are at least ``threshold`` alike (:func:`masked_similarity`). It catches a
questioner that re-asks one template with new numbers, not a reworded one; the paper's gate is
the model judge.
"""

from __future__ import annotations

import random
import re
from typing import Iterator

from sptool.models.base import Backend, SamplingParams
from sptool.prompts import PromptSpec, load_prompt
from sptool.core.records import Field, InputError, RecordKind, UsageError, content_id, ensure_id, iter_chunks
from sptool.core.stage import Stage

SAME, DIFFERENT, UNPARSED = "same", "different", "unparsed"


_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def masked_similarity(a: str, b: str, mask_numbers: bool = True) -> float:
    """How alike two problems are once their numbers are masked: the normalised Indel similarity
    ``1 − (insertions + deletions) / (len(a′) + len(b′))`` (rapidfuzz ``fuzz.ratio`` / 100) of
    a′, b′ = the lower-cased texts with whitespace collapsed and every number replaced by ``#``.
    1.0 for the same template with other numbers; unrelated short problems score about 0.3–0.5.
    ``mask_numbers`` False compares the numbers too: 1.0 only for the same problem."""
    from rapidfuzz import fuzz

    def mask(text: str) -> str:
        text = " ".join(text.lower().split())
        return _NUMBER.sub("#", text) if mask_numbers else text

    return fuzz.ratio(mask(a), mask(b)) / 100.0


class LexicalJudge:
    """A same-task judge without a model: ``same`` when :func:`masked_similarity` ≥ ``threshold``;
    the raw verdict records the similarity. ``mask_numbers`` False with ``threshold`` 1.0 judges
    only a repeated problem the same: the gate for a task of one template (two-digit sums), where
    every proposal is the paper's "same task type" and the masked gate zeroes every reward."""

    model_id = "lexical"

    def __init__(self, threshold: float = 0.6, mask_numbers: bool = True):
        if not 0.0 < threshold <= 1.0:
            raise UsageError(f"the lexical judge's similarity threshold must be in (0, 1], got {threshold}")
        self.threshold, self.mask_numbers = threshold, mask_numbers

    def judge(self, pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
        out = []
        for a, b in pairs:
            similarity = masked_similarity(a, b, self.mask_numbers)
            out.append((SAME if similarity >= self.threshold else DIFFERENT, f"similarity {similarity:.3f}"))
        return out

    def close(self) -> None:
        pass


def novelty_pass_probability(same_type_share: float, k: int) -> float:
    """R-Quest: a candidate whose type has share p of the batch passes with probability ≈ (1 − p)^K.

    (Paper: K = 8 gives ≈ 43% at p = 10% and ≈ 6% at p = 30%.)
    """
    return (1.0 - same_type_share) ** k


_NEGATIVE = re.compile(r"\b(?:no|not\s+(?:the\s+)?same(?:\s+type)?|different|distinct|false)\b",
                       re.IGNORECASE)
_POSITIVE = re.compile(r"\b(?:yes|same|identical|true)\b", re.IGNORECASE)


def _classify(fragment: str) -> str | None:
    if _NEGATIVE.search(fragment):
        return DIFFERENT
    if _POSITIVE.search(fragment):
        return SAME
    return None


def parse_same_task_verdict(text: str) -> str:
    """The judge's verdict: ``same``, ``different`` or ``unparsed``.

    In order: a leading YES/NO (after markdown or quotes); a ``\\boxed{…}`` verdict; the last
    ``Answer:``/``Verdict:`` line; otherwise the text's keywords when they all point one way
    ("not the same" and "different" count as NO before "same" is looked for).
    """
    stripped = re.sub(r"^[\s*_`'\"#>:-]+", "", text)
    lead = re.match(r"(yes|no)\b", stripped, re.IGNORECASE)
    if lead:
        return SAME if lead.group(1).lower() == "yes" else DIFFERENT
    boxed = re.findall(r"\\boxed\{\s*(?:\\text\{)?\s*([A-Za-z ]+?)\s*\}?\s*\}", text)
    if boxed:
        verdict = _classify(boxed[-1])
        if verdict:
            return verdict
    labelled = re.findall(r"(?:answer|verdict|final answer)\s*[:：]\s*\**\s*([^\n]+)", text, re.IGNORECASE)
    if labelled:
        verdict = _classify(labelled[-1][:40])
        if verdict:
            return verdict
    negatives = len(_NEGATIVE.findall(text))
    positives = len(_POSITIVE.findall(_NEGATIVE.sub(" ", text)))
    if negatives and not positives:
        return DIFFERENT
    if positives and not negatives:
        return SAME
    return UNPARSED


def draw_comparison_partners(n_candidates: int, k: int, rng: random.Random) -> list[list[int]]:
    """For each candidate i, min(K, n − 1) other indices drawn without replacement."""
    partners = []
    for index in range(n_candidates):
        others = [other for other in range(n_candidates) if other != index]
        partners.append(rng.sample(others, min(k, len(others))))
    return partners


def _novelty_input_check(record: dict) -> None:
    if record.get("valid") is False:
        return
    question = record.get("question")
    if not isinstance(question, str) or not question.strip():
        raise InputError("expected a non-empty string (or the record marked \"valid\": false)",
                         field="question")


class _CandidateKind(RecordKind):
    def validate(self, record):
        record = super().validate(record)
        _novelty_input_check(record)
        return record


CANDIDATE = _CandidateKind("question", (
    Field("question", (str,), required=False, nullable=True),
    Field("valid", (bool,), required=False, nullable=True),
))


class NoveltyStage(Stage):
    """Adds ``novelty: {novel, compared: [{id, verdict, raw}], judge, k}`` to each valid candidate.

    Works batch by batch (``batch_size`` records held at once). Records with ``valid: false``
    pass through untouched (counted in the summary) and are never drawn as partners.
    """

    name = "novelty"
    input_kind = CANDIDATE

    def __init__(self, judge: Backend | LexicalJudge, *, k: int = 8, batch_size: int = 2048, seed: int = 0,
                 max_new_tokens: int = 16, prompt: str | PromptSpec | None = None,
                 judge_batch_size: int = 256):
        super().__init__()
        if k < 1:
            raise UsageError(f"--partners must be >= 1, got {k}")
        if batch_size < 2:
            raise UsageError(f"--candidates-per-batch must be >= 2, got {batch_size}")
        self.judge, self.k, self.batch_size, self.seed = judge, k, batch_size, seed
        self.prompt = prompt if isinstance(prompt, PromptSpec) else load_prompt("novelty", prompt)
        self.params = self.prompt.sampling(SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens,
                                                          seed=seed))
        self.judge_batch_size = max(1, judge_batch_size)

    def judge_prompt(self, a: dict, b: dict) -> list[dict[str, str]]:
        return self.prompt.messages(a, problem_a=a["question"], problem_b=b["question"])

    def model_verdicts(self, candidates: list[dict], pairs: list[tuple[int, int]]) -> list[tuple[str, str]]:
        """(verdict, raw reply) of the judge model for every pair, batched, greedy."""
        verdicts: list[tuple[str, str]] = []
        for chunk in iter_chunks(pairs, self.judge_batch_size):
            prompts = [self.judge_prompt(candidates[i], candidates[j]) for i, j in chunk]
            for samples in self.judge.generate(prompts, 1, self.params):
                raw = samples[0].text
                verdicts.append((parse_same_task_verdict(raw), raw))
        return verdicts

    def process(self, records: Iterator[dict]) -> Iterator[dict]:
        for batch_number, batch in enumerate(iter_chunks(records, self.batch_size)):
            candidates = [record for record in batch if record.get("valid") is not False]
            for record in candidates:
                ensure_id(record, record["question"], record.get("answer"))
            rng = random.Random(content_id("novelty", self.seed, batch_number))
            partners = draw_comparison_partners(len(candidates), self.k, rng)
            pairs = [(i, j) for i, others in enumerate(partners) for j in others]
            if isinstance(self.judge, LexicalJudge):
                verdicts = self.judge.judge([(candidates[i]["question"], candidates[j]["question"])
                                             for i, j in pairs])
            else:
                verdicts = self.model_verdicts(candidates, pairs)
            compared: list[list[dict]] = [[] for _ in candidates]
            for (i, j), (verdict, raw) in zip(pairs, verdicts):
                compared[i].append({"id": candidates[j]["id"], "verdict": verdict, "raw": raw})
                if verdict == UNPARSED:
                    self.stats.notes["unparsed verdicts (counted as not same)"] += 1
            self.stats.notes["judgements"] += len(pairs)
            judge_id = getattr(self.judge, "model_id", None)
            for index, record in enumerate(candidates):
                novel = not any(entry["verdict"] == SAME for entry in compared[index])
                record["novelty"] = {"novel": novel, "compared": compared[index],
                                     "judge": judge_id, "k": self.k}
                self.stats.notes["novel" if novel else "not novel"] += 1
            for record in batch:
                if record.get("valid") is False:
                    self.stats.notes["passed through (valid=false)"] += 1
                yield record

    def close(self) -> None:
        self.judge.close()
