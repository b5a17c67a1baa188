"""SvS's filter (SvS, Algorithm 1 and Eq. 4-5): solver groups for original problems and
variants with 0 < Acc < 1, and a synthesis group per solution whose variants hit the band.

Original problems with 0 < Acc < 1 → solver groups; variants (``origin: synthesis``, contiguous
by ``group_id`` = one correct solution) → a synthesis group kept only when some variant's
accuracy is in the band, and variant solver groups with 0 < Acc < 1. With ``format_weight``
w > 0 (not the paper's) the solver reward is (1 − w)·correct + w·format and a group is kept when
its rewards differ, which for w = 0 is exactly 0 < Acc < 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from sptool import rewards as R
from sptool.filter.groups import TrainingGroupFilter, contiguous_groups, is_parsed, samples_of
from sptool.settings import setting


@dataclass
class SvsOptions:
    synthesis_band: tuple[float, float] = setting(
        R.SVS_SYNTHESIS_BAND, "variant accuracy band [LOW, HIGH] with synthesis reward 1",
        "SvS Eq. 6, §4", band=True)
    negative_synthesis: bool = setting(False, "reward negative_synthesis_value (not 0) outside the "
                                       "synthesis band", "SvS §3.3, beside Eq. 6")
    negative_synthesis_value: float = setting(-1.0, "the synthesis reward outside the band when "
                                              "negative_synthesis is on", "SvS §3.3")
    format_weight: float = setting(0.0, "solver reward (1 − w)·correct + w·format (a boxed answer); "
                                   "0 = the paper's binary reward, w > 0 keeps groups whose rewards "
                                   "differ", "SvS Eq. 4 (w = 0)", minimum=0, maximum=1)


def is_variant(record: dict) -> bool:
    return record.get("origin") == "synthesis" or bool(record.get("synthesis_prompt"))


class SvsFilter(TrainingGroupFilter):
    recipe = "svs"
    Options = SvsOptions
    options: SvsOptions

    def solver(self, record: dict, what: str) -> dict | None:
        return self.graded_solver_group(record, self.options.format_weight, what=what,
                                        variant=what == "variant")

    def process(self, records: Iterator[dict]) -> Iterator[dict]:
        o = self.options

        def key(record: dict) -> Any:
            if not is_variant(record):
                return None
            return ("variants", record.get("group_id") or record.get("parent_id"))

        for run in contiguous_groups(records, key):
            if not is_variant(run[0]):
                for record in self.without_verify_errors(run):
                    if record.get("p_hat") is None or not samples_of(record):
                        self.drop(record, "question without a verdict (run solve | verify)")
                        continue
                    group = self.solver(record, "original")
                    if group is not None:
                        yield group
                continue
            variants = self.without_verify_errors(run)
            if not variants:
                continue
            accuracies = [r.get("p_hat") if is_parsed(r) and samples_of(r) else None
                          for r in variants]
            if R.svs_keep_synthesis_group(accuracies, o.synthesis_band):
                synthesis_rewards = [R.synthesis_reward(acc, o.synthesis_band, o.negative_synthesis,
                                                        o.negative_synthesis_value)
                                     for acc in accuracies]
                group = self.generator_group("synthesis", variants, synthesis_rewards,
                                             accuracies=accuracies)
                if group is not None:
                    yield group
            else:
                for record in variants:
                    self.drop(record, "synthesis: no variant of this solution in the band")
            for record, acc in zip(variants, accuracies):
                if acc is None:
                    self.drop(record, "solver: variant unparsable or unsolved")
                    continue
                group = self.solver(record, "variant")
                if group is not None:
                    yield group
