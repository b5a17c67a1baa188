"""WIST's filter (WIST §3.4): challenger groups by the Gaussian variance reward, and one
solver group per document (role balancing).

Records arrive grouped by document (``group_id``, contiguous). Challenger group: all G
candidates, r = exp(−(Var − 0.25)²/σ) for valid QAs and ρ for invalid ones; a document whose
valid QAs all have Var = 0 is skipped; solver group: one valid QA drawn uniformly (seeded) with
binary correctness over its K samples.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator

from sptool import rewards as R
from sptool.filter.groups import TrainingGroupFilter, contiguous_groups, is_parsed, samples_of
from sptool.core.records import content_id
from sptool.settings import setting


@dataclass
class WistOptions:
    sigma: float = setting(R.WIST_SIGMA, "width σ of the challenger's Gaussian variance reward "
                           "exp(−(Var − 1/4)²/σ)", "WIST Eq. 14, App. D", above=0)
    invalid_penalty: float = setting(R.WIST_INVALID_PENALTY, "challenger reward ρ of an invalid QA",
                                     "WIST Eq. 14, App. D")


class WistFilter(TrainingGroupFilter):
    recipe = "wist"
    Options = WistOptions
    options: WistOptions

    def process(self, records: Iterator[dict]) -> Iterator[dict]:
        o = self.options
        for document in contiguous_groups(records, lambda r: r.get("group_id")):
            candidates = self.without_verify_errors(document)
            if not candidates:
                continue
            valid, variances = [], []
            for record in candidates:
                if is_parsed(record):
                    if record.get("var") is None or not samples_of(record):
                        self.drop(record, "valid question without a verdict (run solve | verify)")
                        continue
                    valid.append(record)
                    variances.append(float(record["var"]))
            if not R.wist_document_is_learnable(variances):
                for record in candidates:
                    self.drop(record, "document skipped: every valid QA has Var = 0")
                continue
            valid_ids = {id(r) for r in valid}
            usable = [r for r in candidates if not is_parsed(r) or id(r) in valid_ids]
            challenger_rewards = [
                R.wist_challenger_reward(id(r) in valid_ids, r.get("var"), o.sigma, o.invalid_penalty)
                for r in usable]
            group = self.generator_group("challenger", usable, challenger_rewards)
            if group is not None:
                yield group
            # Role balancing: one valid QA, drawn uniformly, trains the solver.
            rng = random.Random(content_id("wist-solver", self.seed, document[0].get("group_id"),
                                           [r.get("id") for r in valid]))
            chosen = valid[rng.randrange(len(valid))]
            rewards = [R.binary_correctness_reward(s.get("correct")) for s in samples_of(chosen)]
            group = self.solver_group(chosen, rewards)
            if group is not None:
                yield group
            for record in valid:
                if record is not chosen:
                    self.drop(record, "solver: not the QA drawn for role balancing")
