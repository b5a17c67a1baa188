"""Plain RLVR on a labelled set: the baseline every one of the papers compares against.

Per iteration: sample ``problems`` problems from the labelled set (seeded passes over it, as
SvS does); solve each ``samples`` times; grade against the reference answer; reward
``(1 − w)·correct + w·format``; drop the groups whose rewards are all equal (or keep them:
``keep_equal_groups``); one policy update. It is SvS (:mod:`sptool.recipes.svs`) with variational
problem synthesis off: SvS §4 reports its gains against exactly this loop ("standard RLVR").
"""

from __future__ import annotations

from dataclasses import dataclass

from sptool.filter.rlvr import RlvrFilter, RlvrOptions
from sptool.recipes.svs import Svs
from sptool.settings import setting


@dataclass
class RlvrConfig(RlvrOptions):
    """``[rlvr]``: the filter's reward and group settings (:class:`RlvrOptions`) and the loop's
    sampling, with SvS's defaults (§4) where they apply."""

    data: str = setting("", "labelled problems: JSONL, parquet, JSON, CSV, a datasets directory or hf:NAME[:CONFIG][@SPLIT] (data.* maps columns); --data SOURCE")
    problems: int = setting(256, "problems sampled per iteration", "SvS §4", minimum=1)
    samples: int = setting(8, "solutions per problem G", "SvS §4", minimum=1)


class Rlvr(Svs):
    """Plain RLVR: SvS's loop with the synthesis left out."""

    name = "rlvr"
    title = "RLVR"
    Config = RlvrConfig
    Filter = RlvrFilter
    prompt_roles = ("solve",)
    synthesizes = False
