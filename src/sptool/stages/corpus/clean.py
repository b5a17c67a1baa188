"""F_clean (WIST §3.3): main text and title from HTML already fetched, plus quality checks.

- Extraction: ``trafilatura.bare_extraction`` on the HTML string (never trafilatura's own
  ``fetch_url``: fetching is :mod:`sptool.stages.corpus.fetch`'s job and goes through the URL policy).
  It removes navigation, ads, templates and comments. Its ``deduplicate`` option stays off:
  it counts texts in a process-wide LRU cache, so the third extraction of the same page in one
  process (a pool refresh, a later iteration, a second test) came back empty. Duplicates are
  :class:`NearDuplicateIndex`'s job.
- Language: a light, dependency-free heuristic (:func:`english_score`): the share of tokens that
  are common English function words. Running English prose scores about 0.3–0.5; other
  languages written in Latin script score well below 0.1. Only ``en`` (and ``any`` = no
  check) are supported; trafilatura's ``target_language`` would need the optional ``py3langid``.
- Length: at least ``min_chars`` characters of extracted text.
- Near-duplicates: :class:`NearDuplicateIndex` compares a new text with every kept one with
  rapidfuzz's normalised Indel similarity on the first ``prefix_chars`` characters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sptool.core.records import RuntimeFailure, UsageError

ENGLISH_FUNCTION_WORDS = frozenset("""
a about above after again all also an and any are as at be because been before being between both
but by can could did do does each few for from had has have he her here his how i if in into is it
its itself just may more most much must no not now of on once only or other our out over own same
she should so some such than that the their them then there these they this those through to too
under until up very was we were what when where which while who whom why will with would you your
""".split())
_WORD = re.compile(r"[^\W\d_]+", re.UNICODE)

SUPPORTED_LANGUAGES = ("en", "any")


def english_score(text: str, max_words: int = 2000) -> float:
    """Share of words that are common English function words (0 when there are no words)."""
    words = [w.lower() for w in _WORD.findall(text[:20000])][:max_words]
    if not words:
        return 0.0
    return sum(w in ENGLISH_FUNCTION_WORDS for w in words) / len(words)


def language_ok(text: str, lang: str, threshold: float = 0.12) -> bool:
    """The language check: ``en`` requires :func:`english_score` ≥ ``threshold``; ``any`` passes."""
    if lang == "any":
        return True
    if lang == "en":
        return english_score(text) >= threshold
    raise UsageError(f"--lang {lang!r} is not supported; choose from {', '.join(SUPPORTED_LANGUAGES)}")


@dataclass
class Extracted:
    title: str
    text: str


def extract_text(content: str, *, content_type: str = "text/html", url: str | None = None) -> Extracted | None:
    """Main text and title of a page (HTML via trafilatura; plain text as is), or None."""
    if content_type != "text/html":
        text = content.strip()
        first = next((line.strip("# ").strip() for line in text.splitlines() if line.strip()), "")
        return Extracted(title=first[:200], text=text) if text else None
    try:
        import trafilatura
    except ImportError as error:  # pragma: no cover - depends on the environment
        # installed but broken (lxml without lxml_html_clean) reads differently from missing
        reason = f" (importing it failed: {str(error).splitlines()[0]})" if error.name != "trafilatura" else ""
        raise RuntimeFailure(f"corpus fetch needs trafilatura: pip install 'sptool[web]'{reason}") from None
    document = trafilatura.bare_extraction(
        content, url=url, with_metadata=True, include_comments=False, include_tables=True,
        include_images=False, include_links=False, deduplicate=False, favor_precision=True)
    if document is None:
        return None
    text = (getattr(document, "text", None) or "").strip()
    title = (getattr(document, "title", None) or "").strip()
    if not title:
        match = re.search(r"<title[^>]*>(.*?)</title>", content, re.IGNORECASE | re.DOTALL)
        title = re.sub(r"\s+", " ", match.group(1)).strip() if match else ""
    return Extracted(title=title, text=text) if text else None


class NearDuplicateIndex:
    """Texts kept so far; :meth:`find` returns the key of a near-duplicate (similarity ≥ threshold).

    Similarity is rapidfuzz's ``fuzz.ratio`` / 100 (normalised Indel distance) on the first
    ``prefix_chars`` characters with whitespace collapsed.
    """

    def __init__(self, threshold: float = 0.9, prefix_chars: int = 4000):
        self.threshold, self.prefix_chars = threshold, prefix_chars
        self._texts: list[tuple[str, str]] = []

    def _norm(self, text: str) -> str:
        return " ".join(text.split())[: self.prefix_chars].lower()

    def find(self, text: str) -> tuple[str, float] | None:
        from rapidfuzz import fuzz

        probe = self._norm(text)
        cutoff = self.threshold * 100
        for key, kept in self._texts:
            score = fuzz.ratio(probe, kept, score_cutoff=cutoff)
            if score >= cutoff:
                return key, score / 100
        return None

    def add(self, key: str, text: str) -> None:
        self._texts.append((key, self._norm(text)))
