"""Web-grounded corpus for WIST (§3.3): search → URL policy → title similarity → fetch → clean.

Modules: :mod:`.search` (backends), :mod:`.policy` (F_url), :mod:`.fetch` (safe HTTP),
:mod:`.clean` (F_clean), :mod:`.similarity` (τ_emb), :mod:`.pool` (per-leaf pools) and
:mod:`.stage` (:class:`CorpusFetchStage`). Nothing heavy is imported here.
"""

from sptool.stages.corpus.stage import CorpusFetchStage

__all__ = ["CorpusFetchStage"]
