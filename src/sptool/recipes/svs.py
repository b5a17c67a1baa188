"""SvS: self-play with variational problem synthesis (Liang et al., 2025).

Algorithm 1, per iteration: sample problems from the labelled set; solve each G times and grade
against the reference; for each under-performing problem (accuracy in the band), the policy
writes G_v variants from one of its correct solutions; the variants are solved and graded
against the original answer; the filter keeps original and variant solver groups with
0 < Acc < 1 and a synthesis group when a variant's accuracy is in the synthesis band; one policy
update over all of them. Rewards: :mod:`sptool.rewards` (SvS section); the filter:
:mod:`sptool.filter`; the variants: :class:`sptool.stages.challenge.SolutionChallengeStage`.
"""

from __future__ import annotations

from dataclasses import dataclass

from sptool import rewards as R
from sptool.filter.svs import SvsFilter, SvsOptions
from sptool.recipes.base import Recipe, has_samples, marked_valid, walk
from sptool.core.records import UsageError
from sptool.run.steps import Step, StepContext, stage_seed
from sptool.settings import setting


@dataclass
class SvsConfig(SvsOptions):
    """``[svs]``: the filter's synthesis band and solver reward (:class:`SvsOptions`) and the
    loop's settings. Defaults: SvS §4 "Implementation Details"."""

    data: str = setting("", "labelled problems: JSONL, parquet, JSON, CSV, a datasets directory or hf:NAME[:CONFIG][@SPLIT], package:NAME (shipped with sptool) (data.* maps columns); --data SOURCE")
    problems: int = setting(256, "problems sampled per iteration", "SvS §4", minimum=1)
    samples: int = setting(8, "solutions per problem G", "SvS §4", minimum=1)
    variants: int = setting(8, "variants written per correct solution G_v", "SvS §4", minimum=1)
    band: tuple[float, float] = setting(R.SVS_UNDERPERFORMING_BAND, "under-performing accuracy band "
                                        "[acc_l, acc_h] whose problems get variants", "SvS §3.3, §4",
                                        band=True)
    strict_band: bool = setting(False, "acc_l < Acc < acc_h (Algorithm 1 line 11) instead of the closed "
                                "range of §3.3", "SvS Algorithm 1")
    max_solutions: int = setting(8, "correct solutions per problem that get variants", minimum=1)


class Svs(Recipe):
    """SvS (Algorithm 1): sample, solve, grade; synthesize variants of the under-performing
    problems and grade them against the original answer; one update over both."""

    name = "svs"
    title = "SvS"
    Config = SvsConfig
    Filter = SvsFilter
    prompt_roles = ("solve", "synthesis")
    needs_data = True
    synthesizes = True  # plain RLVR (:class:`~sptool.recipes.rlvr.Rlvr`) leaves the synthesis out

    def __init__(self, config: dict, session) -> None:
        super().__init__(config, session)
        self._data: list[dict] | None = None

    def plan(self, iteration: int) -> list[Step]:
        steps = [Step("sample", self.sample),
                 Step("solve", self.session.solve(self.c.samples, trained=True), inputs=["sample"]),
                 Step("verify", self.session.verify(pseudo_label=False), inputs=["solve"])]
        graded = ["verify"]
        if self.synthesizes:
            steps += self.synthesis()
            graded.append("verify-variants")
        return steps + [Step("filter", self.filter(), inputs=graded),
                        Step("train", self.session.train(self.session.roles()), inputs=["filter"])]

    def synthesis(self) -> list[Step]:
        """Variational problem synthesis (SvS §3.3): variants from correct solutions of the
        under-performing problems, solved and graded against the original answer."""
        return [
            Step("challenge", self.synthesize, inputs=["verify"]),
            Step("solve-variants", self.session.solve(self.c.samples, trained=True), inputs=["challenge"],
                 only=marked_valid, kind="solve"),
            Step("verify-variants", self.session.verify(pseudo_label=False), inputs=["solve-variants"],
                 only=has_samples, kind="verify"),
        ]

    def data(self) -> list[dict]:
        """The labelled training set (``--data``), read once."""
        if self._data is None:
            from sptool.stages.problemsets import read_labelled_problems
            from sptool.stages.problemsets.columns import mapping_of

            if not self.c.data:
                raise UsageError(f"{self.name} needs a labelled problem set: --data FILE "
                                 "(JSONL with question, answer)")
            self._data = read_labelled_problems(self.c.data, self.title, mapping_of(self.settings))
        return self._data

    def sample(self, ctx: StepContext, records: list[dict]) -> list[dict]:
        """``problems`` problems per iteration, walking seeded permutations of the data set."""
        run_seed = self.settings.run.seed
        chosen = walk(self.data(), self.c.problems, ctx.iteration - 1,
                      lambda epoch: stage_seed(run_seed, epoch, "svs-epoch"))
        out = []
        for record in chosen:
            record = dict(record)
            record.setdefault("origin", "dataset")
            out.append(record)
            ctx.advance()
        return out

    def synthesize(self, ctx: StepContext, records: list[dict]) -> list[dict]:
        """Variants of the under-performing problems, each from one correct solution."""
        from sptool.stages.challenge import SolutionChallengeStage

        c = self.c
        stage = SolutionChallengeStage(self.session.policy("policy").backend, candidates=c.variants,
                                       params=self.session.params(ctx.seed, logprobs=True), band=c.band,
                                       strict_band=c.strict_band, max_solutions=c.max_solutions,
                                       batch_size=self.settings.generation.prompts_per_call,
                                       prompt=self.session.prompt("synthesis"))
        return ctx.run_stage(stage, [r for r in records if r.get("samples")])
