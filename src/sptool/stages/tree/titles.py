"""Matching a proposed label against search titles and siblings, and cleaning a proposal (WIST §3.2)."""

from __future__ import annotations

import re
from typing import Iterable
from sptool.stages.tree.document import DEFAULT_DUPLICATE_THRESHOLD



def string_similarity(a: str, b: str) -> float:
    """sim_str of WIST eq. 9: normalised Indel similarity in [0, 1] of lower-cased, trimmed strings."""
    from rapidfuzz import fuzz, utils

    return fuzz.ratio(a, b, processor=utils.default_process) / 100.0


def title_match(label: str, titles: Iterable[str]) -> tuple[float, str | None]:
    """s_max = max_{w ∈ Ŵ} sim_str(label, w) (WIST eq. 9) and the best title."""
    best, best_title = 0.0, None
    for title in titles:
        score = string_similarity(label, title)
        if score > best:
            best, best_title = score, title
    return best, best_title


def near_duplicate(label: str, others: Iterable[str],
                   threshold: float = DEFAULT_DUPLICATE_THRESHOLD) -> tuple[str, float] | None:
    """The first of ``others`` whose similarity to ``label`` is ≥ ``threshold`` (token order ignored)."""
    from rapidfuzz import fuzz, utils

    for other in others:
        score = max(fuzz.ratio(label, other, processor=utils.default_process),
                    fuzz.token_sort_ratio(label, other, processor=utils.default_process)) / 100.0
        if score >= threshold:
            return other, score
    return None


_BULLET = re.compile(r"^\s*(?:[-*•#>]+|\d+[.)]|[a-z][.)])\s+", re.IGNORECASE)
_PREFIX = re.compile(r"^\s*(?:new\s+)?(?:sub-?topic|topic|label|answer|name|category)\s*(?:name)?\s*[:：-]\s*",
                     re.IGNORECASE)


def clean_proposal(text: str, max_words: int = 8) -> str | None:
    """The topic label in a model reply: first non-empty line, bullets/quotes/markup removed.

    Returns None when nothing usable remains or the label is longer than ``max_words`` words.
    """
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        line = _BULLET.sub("", line)
        line = _PREFIX.sub("", line)
        line = line.replace("**", "").replace("__", "").replace("`", "")
        if ":" in line:  # "Sure! Here is a new subtopic: Combinatorics" / "Here it is:" + next line
            tail = line.rsplit(":", 1)[1].strip()
            if not tail:
                continue
            line = tail
        quoted = re.search(r'["“]([^"”]+)["”]?', line)  # 'The new subtopic is "Prime numbers"'
        if quoted and quoted.group(1).strip():
            line = _BULLET.sub("", quoted.group(1).strip())
        line = line.strip().strip("\"'“”‘’«»").strip()
        line = re.split(r"(?<=[a-z0-9)])[.;:!?](?:\s|$)| - | — |\(", line, maxsplit=1)[0]
        line = line.strip().rstrip(".,;:!?").strip().strip("\"'“”‘’").strip()
        if not line or not re.search(r"[A-Za-z]", line):
            return None
        if len(line.split()) > max_words or len(line) > 80:
            return None
        return line
    return None
