"""``filter``: verified records -> training groups, one filter per recipe (rewards and gates).

- :mod:`.groups`: the training-group builder and record helpers every filter shares;
- :mod:`.wist`: WIST (challenger variance reward, role-balanced solver groups);
- :mod:`.pseudo_label`: R-Zero, R-Quest on top of it (one scoring hook), replay, and R-Quest's
  validity initialisation;
- :mod:`.svs`: SvS (solver groups with 0 < Acc < 1, synthesis groups by the band);
- :mod:`.rlvr`: plain RLVR (SvS without synthesis; optionally keeping all-equal groups).

Every formula lives in :mod:`sptool.rewards`. ``FILTERS`` maps a recipe name to its filter
class; ``FILTERS.get(name).Options`` is its options dataclass (the recipe's filter settings).
"""

from __future__ import annotations

from sptool.core.registry import Registry

FILTERS: Registry = Registry("recipe", {
    "wist": "sptool.filter.wist:WistFilter",
    "svs": "sptool.filter.svs:SvsFilter",
    "rlvr": "sptool.filter.rlvr:RlvrFilter",
    "rzero": "sptool.filter.pseudo_label:RZeroFilter",
    "rquest": "sptool.filter.pseudo_label:RQuestFilter",
})

__all__ = ["FILTERS"]
