"""Plain RLVR's filter (SvS with synthesis off): one solver group per labelled problem.

The reward of each sample is ``(1 − w)·correct + w·format`` (SvS Eq. 4 at ``w = 0``: binary
correctness against the reference answer; ``w > 0`` adds a format term for a boxed answer).
A group whose rewards are all equal has all-zero Dr. GRPO advantages: it is dropped, as SvS
Algorithm 1 and DAPO's dynamic sampling do, unless ``keep_equal_groups`` (what TRL's
``GRPOTrainer`` and a bare loop do: the groups then still count in the Dr. GRPO normaliser N·L).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from sptool.filter.groups import TrainingGroupFilter, samples_of, verify_error_of
from sptool.settings import setting


@dataclass
class RlvrOptions:
    format_weight: float = setting(0.0, "solver reward (1 − w)·correct + w·format (a boxed answer); "
                                   "0 = binary correctness", "SvS Eq. 4 (w = 0)", minimum=0, maximum=1)
    keep_equal_groups: bool = setting(False, "keep groups whose rewards are all equal (zero advantages; "
                                      "they still count in the Dr. GRPO normaliser), as TRL does",
                                      "SvS Alg. 1 line 8 and DAPO dynamic sampling drop them")


class RlvrFilter(TrainingGroupFilter):
    recipe = "rlvr"
    Options = RlvrOptions
    options: RlvrOptions

    def process(self, records: Iterator[dict]) -> Iterator[dict]:
        weight = self.options.format_weight
        for record in records:
            if verify_error_of(record):
                self.drop(record, "verify_error")
                continue
            samples = samples_of(record)
            if record.get("p_hat") is None or not samples:
                self.drop(record, "question without a verdict (run solve | verify)")
                continue
            group = self.graded_solver_group(record, weight, keep_equal=self.options.keep_equal_groups)
            if group is not None:
                yield group
