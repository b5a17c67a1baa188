"""SvS: self-play with variational problem synthesis (Liang et al., 2025; seed 001).

Algorithm 1, per iteration: sample problems from the labelled set; solve each G times and grade
against the reference; for each under-performing problem (accuracy in the band), the policy
writes G_v variants from one of its correct solutions; the variants are solved and graded
against the original answer; the filter keeps original and variant solver groups with
0 < Acc < 1 and a synthesis group when a variant's accuracy is in the synthesis band; one policy
update over all of them. Rewards: :mod:`sptool.rewards` (SvS section); the filter:
:mod:`sptool.filter`; the variants: :class:`sptool.challenge.SolutionChallengeStage`.
"""

from __future__ import annotations

import random

from sptool.recipes.base import Recipe, has_samples, is_parsed
from sptool.records import UsageError
from sptool.run.steps import Step, StepContext, stage_seed

CHALLENGE_BATCH = 4  # solutions per generate call when writing variants


class Svs(Recipe):
    name = "svs"

    def __init__(self, config: dict, session) -> None:
        super().__init__(config, session)
        self._data: list[dict] | None = None

    def plan(self, iteration: int) -> list[Step]:
        s, c = self.session, self.c
        return [
            Step("sample", self.sample),
            Step("solve", s.solve(c.samples), inputs=["sample"]),
            Step("verify", s.verify(pseudo_label=False), inputs=["solve"]),
            Step("challenge", self.synthesize, inputs=["verify"]),
            Step("solve-variants", s.solve(c.samples), inputs=["challenge"], only=is_parsed, kind="solve"),
            Step("verify-variants", s.verify(pseudo_label=False), inputs=["solve-variants"],
                 only=has_samples, kind="verify"),
            Step("filter", self.filter(), inputs=["verify", "verify-variants"]),
            Step("train", s.train(s.roles()), inputs=["filter"]),
        ]

    def data(self) -> list[dict]:
        """The labelled training set (``--data``), read once."""
        if self._data is None:
            from sptool.run.session import read_labelled_problems

            if not self.c.data:
                raise UsageError("svs needs a labelled problem set: --data FILE (JSONL with question, answer)")
            self._data = read_labelled_problems(self.c.data, "SvS")
        return self._data

    def sample(self, ctx: StepContext, records: list[dict]) -> list[dict]:
        """``problems`` problems per iteration, walking seeded permutations of the data set."""
        data = self.data()
        n, per = len(data), self.c.problems
        out = []
        for position in range((ctx.iteration - 1) * per, ctx.iteration * per):
            epoch, offset = divmod(position, n)
            order = list(range(n))
            random.Random(stage_seed(self.config["run"]["seed"], epoch, "svs-epoch")).shuffle(order)
            record = dict(data[order[offset]])
            record.setdefault("origin", "dataset")
            out.append(record)
            ctx.advance()
        return out

    def synthesize(self, ctx: StepContext, records: list[dict]) -> list[dict]:
        """Variants of the under-performing problems, each from one correct solution."""
        from sptool.challenge import SolutionChallengeStage

        c = self.c
        stage = SolutionChallengeStage(self.session.policy("policy").backend, candidates=c.variants,
                                       params=self.session.params(ctx.seed), band=tuple(c.band),
                                       max_solutions=c.max_solutions, batch_size=CHALLENGE_BATCH,
                                       prompt=self.session.prompt("synthesis"))
        return ctx.run_stage(stage, [r for r in records if r.get("samples")])
