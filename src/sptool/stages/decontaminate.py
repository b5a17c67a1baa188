"""Benchmark decontamination: drop records whose question (or document text) overlaps a benchmark problem.

Self-play writes its own training data, and WIST reads the open web, where benchmark problems
are posted verbatim; a questioner can also simply recall a test problem. A record is contaminated
when its text, normalised (Unicode NFKC, case-folded, punctuation and whitespace dropped, so
only the word sequence counts), shares with a benchmark problem

- a run of ``n`` words (``n``-gram overlap, n = 13 by default, the GPT-3 paper's test-set
  filter); a problem shorter than ``n`` words (and at least ``min_words`` long) counts when the
  whole problem appears in the record; or
- a MinHash estimate of Jaccard similarity over word pairs (``shingle`` = 2) of at least
  ``threshold`` (0.7; near-copies with a few words changed; datasketch's MinHash LSH finds the
  candidates).

Each match names the benchmark file, the problem's id and the matched span (the longest run of
normalised words the two texts share). Benchmark files are indexed once per process
(:func:`load_index` caches on the files and the parameters), so a run that checks every
iteration's questions pays for the index once.
"""

from __future__ import annotations

import difflib
import os
import re
import unicodedata
import zlib
from dataclasses import dataclass
from typing import Iterator

from sptool.core.records import OPTIONAL_TEXT, Field, describe, InputError, RecordKind, UsageError, record_error
from sptool.core.stage import Stage

_WORD = re.compile(r"\w+")

# Fields checked in each record, in order: generated questions, then WIST's fetched documents.
CHECKED_FIELDS = ("question", "text")


def normalised_words(text: str) -> list[str]:
    """The text as a list of words: NFKC, case-folded, punctuation and whitespace dropped."""
    return _WORD.findall(unicodedata.normalize("NFKC", text).casefold())


BENCHMARK_PROBLEM = RecordKind("benchmark problem", (
    Field("question", (str,), check=lambda text: None if normalised_words(text) else "expected text with words",
          help="the benchmark problem's text"),
    Field("id", (str, int), required=False, nullable=True,
          help="the problem's id (default: #N, its position in the file)"),
))


@dataclass(frozen=True)
class Problem:
    benchmark: str
    problem_id: str
    words: tuple[str, ...]


@dataclass(frozen=True)
class Match:
    """Where a record overlaps a benchmark problem."""

    benchmark: str
    problem_id: str
    method: str          # "ngram" (a shared run of n words) or "minhash" (near-copy)
    span: str            # the longest run of normalised words both share
    similarity: float    # MinHash Jaccard estimate (1.0 for an n-gram match's share of the problem)

    def as_dict(self) -> dict:
        return {"benchmark": self.benchmark, "problem_id": self.problem_id, "method": self.method,
                "span": self.span, "similarity": round(self.similarity, 4)}


def _identity(value: int) -> int:
    return value


def _longest_shared_run(a: tuple[str, ...] | list[str], b: tuple[str, ...] | list[str]) -> str:
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    match = matcher.find_longest_match(0, len(a), 0, len(b))
    return " ".join(a[match.a:match.a + match.size])


class TextIndex:
    """Word n-grams and MinHash LSH over texts added one by one (:meth:`add`), queried with
    :meth:`match`. :class:`BenchmarkIndex` fills one from benchmark files; curriculum health
    fills one with a run's questions to count near-duplicates."""

    def __init__(self, *, ngram: int = 13, min_words: int = 8, threshold: float | None = 0.7,
                 num_perm: int = 128, shingle: int = 2):
        if ngram < 1:
            raise UsageError(f"--ngram must be at least 1, got {ngram}")
        if threshold is not None and not 0.0 < threshold <= 1.0:
            raise UsageError(f"--minhash-threshold must be in (0, 1], got {threshold}")
        self.ngram, self.min_words, self.threshold = ngram, min_words, threshold
        self.num_perm, self.shingle = num_perm, shingle
        self.problems: list[Problem] = []
        self._grams: dict[int, list[int]] = {}     # hash of an n-gram -> problem indices
        self._short: dict[int, dict[int, list[int]]] = {}  # length -> hash of a whole short problem -> indices
        self._exact: dict[tuple[str, ...], int] = {}      # whole problems (any length) -> index
        self._lsh = None
        self._minhashes: dict[str, object] = {}
        self._word_hash: dict[str, int] = {}
        self._min_shingles, self._max_shingles = float("inf"), 0.0
        if threshold is not None:
            self._start_lsh()

    # ------------------------------------------------------------ building

    def add(self, source: str, problem_id: str, text: str) -> None:
        """Index one text (its words normalised); a text without words is ignored."""
        words = tuple(normalised_words(text))
        if not words:
            return
        index = len(self.problems)
        self.problems.append(Problem(source, problem_id, words))
        n = self.ngram
        self._exact.setdefault(words, index)
        if len(words) >= n:
            for position in range(len(words) - n + 1):
                bucket = self._grams.setdefault(hash(words[position:position + n]), [])
                if not bucket or bucket[-1] != index:
                    bucket.append(index)
        elif len(words) >= self.min_words:
            self._short.setdefault(len(words), {}).setdefault(hash(words), []).append(index)
        if self._lsh is not None:
            shingles = self._shingle_hashes(words)
            minhash = self._new_minhash()
            minhash.update_batch(shingles)
            key = str(index)
            self._minhashes[key] = minhash
            self._lsh.insert(key, minhash, check_duplication=False)
            # Jaccard(A, B) <= min(|A|, |B|) / max(|A|, |B|): a text with more shingles than this
            # (or fewer than the lower bound) cannot reach the threshold with any indexed text.
            self._max_shingles = max(self._max_shingles, len(shingles) / self.threshold)
            self._min_shingles = min(self._min_shingles, len(shingles) * self.threshold)

    def _shingle_hashes(self, words: tuple[str, ...] | list[str]):
        """32-bit hashes of the distinct word ``shingle``-grams (crc32 of each word, combined: the
        same in every process, so results do not depend on Python's hash seed)."""
        import numpy as np

        word_hash = self._word_hash
        values = []
        for word in words:
            value = word_hash.get(word)
            if value is None:
                value = zlib.crc32(word.encode())
                if len(word_hash) < 1_000_000:
                    word_hash[word] = value
            values.append(value)
        hashes = np.array(values, dtype=np.uint64)
        k = min(self.shingle, len(values))
        combined = hashes[:len(values) - k + 1].copy()
        for offset in range(1, k):
            combined = (combined * np.uint64(1_000_003) + hashes[offset:len(values) - k + 1 + offset]) \
                & np.uint64(0xFFFFFFFF)
        return np.unique(combined)

    def _new_minhash(self):
        from datasketch import MinHash

        return MinHash(num_perm=self.num_perm, permutations=self._permutations, scheme=self._scheme,
                       hashfunc=_identity)

    def _start_lsh(self) -> None:
        try:
            from datasketch import MinHash, MinHashLSH
        except ImportError:  # pragma: no cover - a declared dependency
            raise UsageError("MinHash near-copy detection needs datasketch: pip install datasketch") from None
        template = MinHash(num_perm=self.num_perm, seed=1)
        self._permutations, self._scheme = template.permutations, template.scheme
        # LSH only proposes candidates (each is checked against the threshold), so its bands are
        # tuned against false negatives: a pair at the threshold is proposed ~92% of the time
        # (datasketch's even weighting: ~44%).
        self._lsh = MinHashLSH(threshold=self.threshold, num_perm=self.num_perm, weights=(0.1, 0.9))
        self._scratch = self._new_minhash()  # reused for every query (no construction per record)

    # ------------------------------------------------------------ matching

    def match(self, text: str) -> Match | None:
        """The first indexed text that ``text`` overlaps, or None."""
        words = normalised_words(text)
        if not words or not self.problems:
            return None
        key = tuple(words)
        if key in self._exact:
            problem = self.problems[self._exact[key]]
            return Match(problem.benchmark, problem.problem_id, "ngram", " ".join(words), 1.0)
        found = self._ngram_match(words)
        if found is not None:
            return found
        if self._lsh is not None:
            return self._minhash_match(words)
        return None

    def _ngram_match(self, words: list[str]) -> Match | None:
        n = self.ngram
        grams = self._grams
        for position in range(len(words) - n + 1):
            gram = tuple(words[position:position + n])
            for index in grams.get(hash(gram), ()):
                problem = self.problems[index]
                if self._contains(problem.words, gram):
                    return self._ngram_result(problem, words)
        for length, table in self._short.items():
            for position in range(len(words) - length + 1):
                run = tuple(words[position:position + length])
                for index in table.get(hash(run), ()):
                    problem = self.problems[index]
                    if problem.words == run:
                        return self._ngram_result(problem, words)
        return None

    @staticmethod
    def _contains(haystack: tuple[str, ...], needle: tuple[str, ...]) -> bool:
        size = len(needle)
        first = needle[0]
        for position, word in enumerate(haystack[:len(haystack) - size + 1]):
            if word == first and haystack[position:position + size] == needle:
                return True
        return False

    def _ngram_result(self, problem: Problem, words: list[str]) -> Match:
        span = _longest_shared_run(problem.words, words)
        return Match(problem.benchmark, problem.problem_id, "ngram", span,
                     len(span.split()) / len(problem.words))

    def _minhash_match(self, words: list[str]) -> Match | None:
        shingles = self._shingle_hashes(words)
        if not self._min_shingles <= len(shingles) <= self._max_shingles:
            return None
        minhash = self._scratch
        minhash.clear()
        minhash.update_batch(shingles)
        best, best_similarity = None, 0.0
        for key in self._lsh.query(minhash):
            similarity = minhash.jaccard(self._minhashes[key])
            if similarity >= self.threshold and similarity > best_similarity:
                best, best_similarity = key, similarity
        if best is None:
            return None
        problem = self.problems[int(best)]
        return Match(problem.benchmark, problem.problem_id, "minhash",
                     _longest_shared_run(problem.words, words), best_similarity)


class BenchmarkIndex(TextIndex):
    """A :class:`TextIndex` over the problems of one or more benchmark sources (any
    :mod:`sptool.stages.problemsets` source: JSONL ``question``, optional ``id``; parquet, CSV, a
    datasets directory, ``hf:``, columns mapped by ``mapping``; a bad row is a ``source:row`` error)."""

    def __init__(self, paths: list[str], mapping=None, **options):
        if not paths:
            raise UsageError("decontamination needs at least one --benchmark file")
        super().__init__(**options)
        from sptool.stages.problemsets import iter_problems

        for path in paths:
            count = 0
            for number, record in iter_problems(path, BENCHMARK_PROBLEM, mapping):
                count += 1
                problem_id = record.get("id")
                self.add(path, str(problem_id) if problem_id is not None else f"#{count}", record["question"])
            if count == 0:
                raise InputError("no problems in the benchmark file", source=path)


_INDEXES: dict[tuple, BenchmarkIndex] = {}


def load_index(paths: list[str], **options) -> BenchmarkIndex:
    """A :class:`BenchmarkIndex`, built once per process for the same files (path, size, mtime)
    and options."""
    key_files = []
    for path in paths:
        try:
            stat = os.stat(path)
            key_files.append((os.path.abspath(path), stat.st_size, stat.st_mtime_ns))
        except OSError:
            key_files.append((path, None, None))  # the reader reports the missing file
    key = (tuple(key_files), tuple(sorted(options.items())))
    if key not in _INDEXES:
        _INDEXES[key] = BenchmarkIndex(list(paths), **options)
    return _INDEXES[key]


class DecontaminateStage(Stage):
    """Drops records whose ``question`` (or, for WIST documents, ``text``) overlaps a benchmark
    problem; each dropped record carries ``contamination`` (benchmark, problem_id, method, span,
    similarity) to the rejects. Records with neither field pass through; a ``question`` or
    ``text`` that is not a string is an error (a question wrapped in a list must not evade the gate).

    ``mark_invalid``: keep a contaminated question, marked ``valid: false`` with
    ``invalid_reason`` and ``contamination`` (in a self-play loop the questioner then gets the
    penalty of an invalid question, and no solver sees it); documents are still dropped."""

    input_kind = OPTIONAL_TEXT

    name = "decontaminate"

    def __init__(self, index: BenchmarkIndex, *, fields: tuple[str, ...] = CHECKED_FIELDS,
                 mark_invalid: bool = False):
        super().__init__()
        self.index = index
        self.fields = fields
        self.mark_invalid = mark_invalid

    def check(self, record: dict) -> Match | None:
        for name in self.fields:
            value = record.get(name)
            if isinstance(value, str) and value.strip():
                return self.index.match(value)
        return None

    def process(self, records: Iterator[dict]) -> Iterator[dict]:
        for record in records:
            for name in self.fields:
                if record.get(name) is not None and not isinstance(record[name], str):
                    raise record_error(f"expected a string, got {describe(record[name])}", record, field=name)
            if not any(isinstance(record.get(name), str) for name in self.fields):
                self.stats.notes["without question or text, passed through"] += 1
                yield record
                continue
            found = self.check(record)
            if found is None:
                yield record
                continue
            record["contamination"] = found.as_dict()
            reason = f"contaminated ({found.method})"
            if self.mark_invalid and isinstance(record.get("question"), str):
                record["valid"] = False
                record["invalid_reason"] = f"{reason}: {found.benchmark} problem {found.problem_id}"
                self.stats.notes[f"marked invalid, {reason}"] += 1
                yield record
                continue
            self.drop(record, reason)
