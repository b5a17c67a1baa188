"""R-Zero and R-Quest: a questioner and a solver evolve from nothing (seed 002).

R-Zero (§2.1), per round: ``questioner_steps`` times, the questioner proposes questions, the
solver answers each m times and the majority is the pseudo-label; the questioner is rewarded for
questions the solver is unsure about (uncertainty − BLEU repetition penalty) and updated. Then
the questioner proposes the solver's questions; those with majority agreement p in the band train
the solver against the majority for ``solver_steps`` updates.

R-Quest (§3) adds a validity gate (the solver first judges each question in validity mode; a
question more than half judge invalid is not solved), a pairwise novelty gate (a frozen judge
compares each question with K others) and a replay of the validity-initialisation set as 10 % of
the solver's groups.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from sptool import rewards as R
from sptool.filter.pseudo_label import RQuestOptions, RZeroOptions
from sptool.recipes.base import Recipe, has_samples, is_parsed
from sptool.run.steps import Step, StepContext
from sptool.settings import setting


@dataclass
class RoundConfig:
    """What one R-Zero/R-Quest round is made of (both papers)."""

    questions: int = setting(512, "questioner candidates per questioner step", "R-Quest App. C.2 "
                             "\"rollout 批 512\"", minimum=1)
    questioner_group: int = setting(4, "questioner samples per prompt (its GRPO group)",
                                    "WIST App. D (R-Zero) \"Challenger sampling 4\"", minimum=1)
    samples: int = setting(10, "solver samples per question m (majority vote)", "R-Quest App. C.2",
                           minimum=1)
    questioner_steps: int = setting(5, "questioner updates per round", "R-Quest App. C.2", minimum=1)
    solver_steps: int = setting(15, "solver updates per round", "R-Quest App. C.2", minimum=1)
    solver_questions: int = setting(512, "questions generated for the solver's data per round",
                                    minimum=1)


@dataclass
class RZeroConfig(RZeroOptions, RoundConfig):
    """``[rzero]``: the filter's settings (:class:`RZeroOptions`) and the round's."""


@dataclass
class RQuestConfig(RQuestOptions, RoundConfig):
    """``[rquest]``: the filter's settings (:class:`RQuestOptions`), the round's, and the gates'."""

    validity_samples: int = setting(9, "validity-mode samples per question for u(q)",
                                    "R-Quest App. C.2 \"有效性采样 9 条\"", minimum=1)
    novelty_k: int = setting(8, "other questions each one is compared with by the judge",
                             "R-Quest §3 \"默认 K=8\"", minimum=1)
    novelty_max_tokens: int = setting(16, "new tokens per novelty verdict", minimum=1)
    replay: str = setting("fixtures/validity_init.jsonl", "the validity-initialisation set, re-solved "
                          "each round and replayed as validity groups (empty: no replay)", "R-Quest §3")
    replay_problems: int = setting(64, "validity-set problems re-solved per round for the replay",
                                   minimum=1)
    bleu_threshold: float = setting(R.BLEU_DISTANCE_THRESHOLD, "unused: R-Quest's questioner reward has "
                                    "no repetition penalty (kept so R-Zero-style configurations load)")


def is_questioner_group(group: dict) -> bool:
    return group.get("role") == "questioner"


def is_math_with_samples(record: dict) -> bool:
    return record.get("mode") == "math" and bool(record.get("samples"))


class RZero(Recipe):
    name = "rzero"
    Config = RZeroConfig
    novelty_gate = False

    def plan(self, iteration: int) -> list[Step]:
        s, c = self.session, self.c
        steps: list[Step] = []
        for step in range(1, c.questioner_steps + 1):
            p = f"q{step}-"
            last = self.propose_and_grade(steps, p, c.questions, novelty=self.novelty_gate)
            steps += [Step(f"{p}filter", self.filter(), inputs=[last], kind="filter"),
                      Step(f"{p}train", s.train(["questioner"], groups=is_questioner_group),
                           inputs=[f"{p}filter"], kind="train")]
        last = self.propose_and_grade(steps, "s-", c.solver_questions, novelty=False)
        steps += self.replay_steps()
        steps += [Step("s-filter", self.solver_filter(), inputs=[last], kind="filter"),
                  Step("s-train", s.train(["solver"], updates=c.solver_steps,
                                          groups=lambda g: not is_questioner_group(g)),
                       inputs=["s-filter"], kind="train")]
        return steps

    def propose_and_grade(self, steps: list[Step], p: str, questions: int, novelty: bool) -> str:
        """Append the steps that propose ``questions`` questions and grade them; returns the name
        of the last one (the filter's input)."""
        s, c = self.session, self.c
        steps.append(Step(f"{p}challenge", self.propose(questions), kind="challenge"))
        last = self.validity_steps(steps, p, f"{p}challenge")
        steps += [Step(f"{p}solve", s.solve(c.samples, "math"), inputs=[last], only=self.solvable,
                       kind="solve"),
                  Step(f"{p}verify", s.verify(pseudo_label=True), inputs=[f"{p}solve"],
                       only=is_math_with_samples, kind="verify")]
        if novelty:
            steps.append(Step(f"{p}novelty", self.judge_novelty, inputs=[f"{p}verify"], kind="novelty"))
            return f"{p}novelty"
        return f"{p}verify"

    # -- hooks R-Quest overrides ----------------------------------------------------------------

    def validity_steps(self, steps: list[Step], p: str, last: str) -> str:
        return last

    @staticmethod
    def solvable(record: dict) -> bool:
        return is_parsed(record)

    def replay_steps(self) -> list[Step]:
        return []

    def solver_filter(self):
        return self.filter()

    # -- step bodies ----------------------------------------------------------------------------

    def propose(self, questions: int):
        """The questioner writes ``questions`` questions from nothing, ``questioner_group`` per prompt."""
        def challenge(ctx: StepContext, records: list[dict]) -> list[dict]:
            from sptool.challenge import NothingChallengeStage

            stage = NothingChallengeStage(self.session.policy("questioner").backend, unseeded=True,
                                          candidates=questions, params=self.session.params(ctx.seed),
                                          batch_size=self.c.questioner_group,
                                          prompt=self.session.prompt("questioner"))
            return ctx.run_stage(stage, [])
        return challenge

    def judge_novelty(self, ctx: StepContext, records: list[dict]) -> list[dict]:
        from sptool.novelty import NoveltyStage

        stage = NoveltyStage(self.session.judge, k=self.c.novelty_k, seed=ctx.seed,
                             max_new_tokens=self.c.novelty_max_tokens, prompt=self.session.prompt("novelty"))
        return ctx.run_stage(stage, records)


class RQuest(RZero):
    name = "rquest"
    Config = RQuestConfig
    novelty_gate = True

    def validity_steps(self, steps: list[Step], p: str, last: str) -> str:
        """u(q): the solver judges each parsed question ``validity_samples`` times."""
        s, c = self.session, self.c
        steps += [Step(f"{p}solve-validity", s.solve(c.validity_samples, "validity"), inputs=[last],
                       only=is_parsed, kind="solve"),
                  Step(f"{p}verify-validity", s.verify(pseudo_label=True), inputs=[f"{p}solve-validity"],
                       only=has_samples, kind="verify")]
        return f"{p}verify-validity"

    @staticmethod
    def solvable(record: dict) -> bool:
        """The validity gate: at most half the validity samples call the question invalid."""
        return is_parsed(record) and (record.get("invalid_frac") or 0) <= 0.5

    def replay_steps(self) -> list[Step]:
        if not self.c.replay:
            return []
        return [Step("s-replay-solve", self.replay_solve, kind="solve"),
                Step("s-replay-verify", self.session.verify(pseudo_label=False), inputs=["s-replay-solve"],
                     kind="verify")]

    def solver_filter(self):
        """The solver's filter, with the replayed validity groups when ``replay`` is set."""
        return self.filter(replay="s-replay-verify") if self.c.replay else self.filter()

    def replay_solve(self, ctx: StepContext, records: list[dict]) -> list[dict]:
        """Re-solve (validity mode) a seeded sample of the validity-initialisation set for replay."""
        from sptool.jsonl import read_records

        pool = list(read_records(self.c.replay))
        chosen = random.Random(ctx.seed).sample(pool, min(self.c.replay_problems, len(pool)))
        return self.session.solve(self.c.validity_samples, "validity")(ctx, chosen)
