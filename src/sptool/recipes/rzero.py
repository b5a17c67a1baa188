"""R-Zero and R-Quest: a questioner and a solver evolve from nothing (R-Quest).

R-Zero (§2.1), per round:

1. ``questioner_steps`` times: the questioner proposes ``questions`` candidates
   (``questioner_group`` per prompt, its GRPO group); the solver answers each ``samples`` (m = 10)
   times and the majority is the pseudo-label; the questioner is rewarded for questions the
   solver is unsure about (uncertainty − BLEU repetition penalty) and updated (``qN-*``).
2. The updated questioner proposes ``solver_questions`` candidates (10,000 a round), graded the
   same way; those whose majority agreement p is in the band, with a non-empty majority, form the
   round's **pool**, labelled with their majority answer (``s-*``, ``s-pool``).
3. ``solver_steps`` times: a batch of ``solver_batch`` pool questions (walking seeded
   permutations of the pool, so each step draws its own batch) gets ``solver_rollouts`` (5)
   **fresh** rollouts from the current solver, graded against the pool's pseudo-label
   (0.9·correct + 0.1·format); these groups, not the voting samples, are the update (``sN-*``).
   Every trained completion carries its sampling log-probabilities (``old_logprobs``).

R-Quest (§3) adds: a validity gate before solving (the solver judges each question in validity
mode; more than half INVALID excludes it and the questioner gets g_valid = 1/2 − u), a pairwise
novelty gate judged by the frozen base model (``model.judge``), the **validity initialisation**
(Table 6, Appendix A.3: ``init_steps`` updates of the solver on ``init_data`` — ``init_samples``
answers per problem, batch ``init_batch``, top-p ``init_top_p`` — run once as iteration 0; the
self-play solver starts from its last checkpoint, which is also its KL reference; the
questioner starts from the base model), and a **replay** of the initialisation task: in every
solver update, ``replay_share`` of the groups are initialisation problems drawn from the whole
set (validity mode, R_init reward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sptool import rewards as R
from sptool.filter.pseudo_label import RQuestFilter, RQuestOptions, RZeroFilter, RZeroOptions
from sptool.recipes.base import Recipe, has_samples, marked_valid, walk  # noqa: F401 - walk: API
from sptool.run.steps import Step, StepContext, stage_seed
from sptool.settings import setting


@dataclass
class RoundConfig:
    """What one R-Zero/R-Quest round is made of (both papers)."""

    questions: int = setting(2048, "questioner candidates per questioner step (prompts × "
                             "questioner_group)", "R-Quest App. B.2 \"questioner 的 rollout 批最初有 2,048 "
                             "个生成候选\" (512 prompts × 4)", minimum=1)
    questioner_group: int = setting(4, "questioner samples per prompt (its GRPO group)",
                                    "WIST App. D (R-Zero) \"Challenger sampling 4\"; R-Quest App. C.2 "
                                    "\"questioner 每输入 4 条回答\"", minimum=1)
    samples: int = setting(10, "solver samples per question m (majority vote = pseudo-label)",
                           "R-Quest App. C.2", minimum=1)
    questioner_steps: int = setting(5, "questioner updates per round", "R-Quest App. C.2 \"每轮 "
                                    "questioner 5 步\"", minimum=1)
    solver_steps: int = setting(15, "solver updates per round, each on its own batch from the pool",
                                "R-Quest App. C.2 \"solver 15 步\"", minimum=1)
    solver_questions: int = setting(10000, "candidates generated per round for the solver's pool "
                                    "(majority-labelled, banded)", "R-Quest §4.1 \"其余方法每轮 "
                                    "10,000 道\"", minimum=1)
    solver_batch: int = setting(512, "questions per solver update (pool draws, plus R-Quest's replay)",
                                "R-Quest App. C.2 \"rollout 批 512\"", minimum=1)
    solver_rollouts: int = setting(5, "fresh rollouts of the current solver per question: the "
                                   "update's GRPO group", "R-Quest App. C.2 \"solver 5 条\"; WIST "
                                   "App. D \"Reasoner sampling 5\"", minimum=1)
    pool_labels: str = setting("majority", "the labels of the solver's pool: majority (the pseudo-label) "
                               "or shuffled, a control: the same majority labels permuted among the "
                               "pool's questions, so each is graded against another question's answer",
                               "majority: R-Zero §2.1; shuffled: sptool's random-label control",
                               choices=("majority", "shuffled"))


@dataclass
class RZeroConfig(RZeroOptions, RoundConfig):
    """``[rzero]``: the filter's settings (:class:`RZeroOptions`) and the round's."""


@dataclass
class RQuestConfig(RQuestOptions, RoundConfig):
    """``[rquest]``: the filter's settings (:class:`RQuestOptions`), the round's, the gates' and
    the validity initialisation's."""

    validity_samples: int = setting(9, "validity-mode samples per question for u(q)",
                                    "R-Quest App. C.2 \"有效性采样 9 条\"", minimum=1)
    novelty_k: int = setting(8, "other questions each one is compared with by the judge",
                             "R-Quest §3 \"默认 K=8\"", minimum=1)
    novelty_max_tokens: int = setting(16, "new tokens per novelty verdict (Yes/No)",
                                      "not stated in R-Quest", minimum=1)
    novelty_judge: str = setting("model", "who judges same-task pairs: the frozen base model "
                                 "(model.judge), or 'lexical': number-masked text similarity of at "
                                 "least novelty_similarity, for models too small to judge",
                                 "R-Quest §3 (the model judge); lexical is sptool's", choices=("model", "lexical"))
    novelty_similarity: float = setting(0.6, "the lexical judge's threshold (1.0: the same template "
                                        "with other numbers; unrelated short problems score 0.3-0.5)",
                                        "sptool's choice", above=0, maximum=1)
    novelty_mask_numbers: bool = setting(True, "the lexical judge masks numbers before comparing (false, "
                                         "with novelty_similarity 1.0: only a repeated question is the "
                                         "same, the gate for a task of one template such as sums, where "
                                         "every proposal is one task type and the masked gate pays nothing)",
                                         "sptool's choice")
    init_data: str = setting("package:validity_init.jsonl", "the labelled validity-initialisation "
                             "set (answer INVALID for a flawed problem), trained on first and replayed "
                             "in every solver update; sptool ships a 12-problem sample",
                             "R-Quest §3.1, Table 4 (1,943 problems)")
    validity_init: bool = setting(True, "train the solver on init_data before self-play (iteration 0); "
                                  "false, or model.solver = CKPT, skips it",
                                  "R-Quest App. A.3 \"第 15 步检查点作为后续 solver 起点\"")
    init_steps: int = setting(15, "validity-initialisation updates", "R-Quest Table 6 \"15 步\"",
                              minimum=1)
    init_batch: int = setting(512, "problems per validity-initialisation update",
                              "R-Quest Table 6 \"批内 512 题\"", minimum=1)
    init_samples: int = setting(8, "validity-mode answers per problem (the group)",
                                "R-Quest Table 6 \"每题 8 条回答\"", minimum=1)
    init_top_p: float = setting(0.99, "nucleus mass of the initialisation's sampling (learning rate, "
                                "KL and temperature are [train] and [generation]'s)",
                                "R-Quest Table 6 \"top-p 0.99\"", above=0, maximum=1)


def is_questioner_group(group: dict) -> bool:
    return group.get("role") == "questioner"


def is_math_with_samples(record: dict) -> bool:
    return record.get("mode") == "math" and bool(record.get("samples"))


def replay_count(count: int, share: float) -> int:
    """``round(count · share)`` (halves up), at least one when both are positive. The replay
    groups of an update with ``n`` pool questions: ``replay_count(n, share / (1 − share))``, so
    that they are ``share`` of its groups (512 = 461 + 51 at the paper's batch); a small batch
    still keeps one."""
    if share <= 0 or count < 1:
        return 0
    return max(1, math.floor(count * share + 0.5))


def shuffled_labels(pool: list[dict], seed: int) -> list[dict]:
    """The random-label control: the pool's majority labels permuted among its questions (seeded),
    so every question keeps a label of the same kind and spread, but none is tied to it. A gain
    under these labels is not the majority vote's doing."""
    import random

    labels = [record["answer"] for record in pool]
    random.Random(seed).shuffle(labels)
    return [{**record, "answer": label, "label_source": "shuffled"} for record, label in zip(pool, labels)]


def passes_the_validity_gate(record: dict) -> bool:
    """R-Quest's validity gate on a voted question: parsed, and g_valid = ½ − u(q) ≥ 0 (at most
    half the validity samples call it invalid)."""
    return marked_valid(record) and R.passes_validity_gate(record.get("invalid_frac") or 0)


class RZero(Recipe):
    """R-Zero (§2.1): per round, questioner updates, the round's solver pool, solver updates."""

    name = "rzero"
    Config = RZeroConfig
    Filter = RZeroFilter
    prompt_roles = ("solve", "questioner")

    def plan(self, iteration: int) -> list[Step]:
        steps: list[Step] = []
        for p in self.questioner_updates():                   # 1. the questioner learns
            steps += self.propose(p, self.c.questions, trained=True)
            steps += self.vote(p, after=f"{p}challenge", only=marked_valid)
            steps += self.train_questioner(p, after=f"{p}verify")
        steps += self.propose("s-", self.c.solver_questions, trained=False)   # 2. the round's pool
        steps += self.vote("s-", after="s-challenge", only=marked_valid)
        steps += self.pool_of("s-", after="s-verify")
        for step in range(1, self.c.solver_steps + 1):      # 3. the solver learns
            steps += self.train_solver(step)
        return steps

    # -- the pieces of a round, each a list of steps ----------------------------------------------

    def questioner_updates(self) -> list[str]:
        """The step-name prefixes of the round's ``questioner_steps`` questioner updates: q1-, q2-, …"""
        return [f"q{step}-" for step in range(1, self.c.questioner_steps + 1)]

    def propose(self, p: str, questions: int, trained: bool) -> list[Step]:
        """The questioner writes ``questions`` questions from nothing (``trained``: with their
        sampling log-probabilities, for its update)."""
        return [Step(f"{p}challenge", self.write_questions(questions, trained), kind="challenge")]

    def vote(self, p: str, after: str, only) -> list[Step]:
        """The solver answers each question (those passing ``only``) ``samples`` times; the
        majority answer is its pseudo-label, its share the agreement p."""
        return [Step(f"{p}solve", self.session.solve(self.c.samples, "math"), inputs=[after], only=only,
                     kind="solve"),
                Step(f"{p}verify", self.session.verify(pseudo_label=True), inputs=[f"{p}solve"],
                     only=is_math_with_samples, kind="verify")]

    def train_questioner(self, p: str, after: str) -> list[Step]:
        """The questioner's reward per question (the recipe's filter) and its update."""
        return [Step(f"{p}filter", self.filter(), inputs=[after], kind="filter"),
                Step(f"{p}train", self.session.train(["questioner"], groups=is_questioner_group),
                     inputs=[f"{p}filter"], kind="train")]

    def pool_of(self, p: str, after: str) -> list[Step]:
        """The round's solver pool: the voted questions the filter keeps for the solver."""
        return [Step(f"{p}pool", self.pool, inputs=[after], kind="pool")]

    def train_solver(self, step: int) -> list[Step]:
        """Solver update ``step``: its own batch from the pool, fresh rollouts of the current
        solver graded against the pool's pseudo-label, the update."""
        p = f"s{step}-"
        return [Step(f"{p}rollout", self.rollouts(step), inputs=["s-pool"], kind="solve"),
                Step(f"{p}verify", self.session.verify(pseudo_label=False), inputs=[f"{p}rollout"],
                     only=has_samples, kind="verify"),
                Step(f"{p}filter", self.rollout_groups, inputs=[f"{p}verify"], kind="filter"),
                Step(f"{p}train", self.session.train(["solver"]), inputs=[f"{p}filter"], kind="train")]

    # -- what R-Quest changes in a solver update ----------------------------------------------------

    share = 0.0  # replay share of every solver update (R-Quest: rquest.replay_share)

    def replay_problems(self, ctx: StepContext, step: int, count: int) -> list[dict]:
        return []

    # -- step bodies ----------------------------------------------------------------------------

    def write_questions(self, questions: int, trained: bool):
        """The questioner writes ``questions`` questions from nothing, ``questioner_group`` per
        prompt (``trained``: with their sampling log-probabilities, for its update)."""
        def challenge(ctx: StepContext, records: list[dict]) -> list[dict]:
            from sptool.stages.challenge import QuestionerStage

            stage = QuestionerStage(self.session.policy("questioner").backend, unseeded=True,
                                    candidates=questions,
                                    params=self.session.params(ctx.seed, logprobs=trained),
                                    batch_size=self.c.questioner_group,
                                    per_call=self.session.settings.model.gen_batch_size,
                                    prompt=self.session.prompt("questioner"))
            return ctx.run_stage(stage, [])
        return challenge

    def pool(self, ctx: StepContext, records: list[dict]) -> list[dict]:
        """The round's solver pool: the candidates the filter keeps for the solver (agreement in
        the band, non-empty majority; R-Quest: past the validity gate), each labelled with its
        majority answer (the pseudo-label the fresh rollouts are graded against)."""
        stage = self.Filter(self.filter_options(self.Filter.Options), questioner=False,
                            advantage=self.advantage, seed=ctx.seed)
        groups = ctx.run_stage(stage, records)
        out = []
        for group in groups:
            if group.get("role") != "solver":
                continue
            out.append({"id": group["source_ids"][0], "question": group["question"],
                        "answer": group["pseudo_label"], "label_source": "majority",
                        "origin": "questioner", "pool": True})
        if self.c.pool_labels == "shuffled":
            return shuffled_labels(out, ctx.seed)
        return out

    def rollouts(self, step: int):
        """Solver step ``step``: its own batch from the pool and fresh rollouts of the current
        solver (``solver_rollouts`` each), plus, for R-Quest, the replayed initialisation
        problems (:meth:`replay_problems`), together ``solver_batch`` questions."""
        def rollout(ctx: StepContext, pool: list[dict]) -> list[dict]:
            if not pool:
                return []
            run_seed = self.settings.run.seed
            size = min(max(1, self.c.solver_batch - replay_count(self.c.solver_batch, self.share)), len(pool))
            chosen = walk(pool, size, step - 1,
                          lambda epoch: stage_seed(run_seed, ctx.iteration, f"pool-epoch-{epoch}"))
            out = self.session.solve_records(ctx, [dict(r) for r in chosen], self.c.solver_rollouts, "math",
                                             trained=True)
            replay = self.replay_problems(ctx, step, replay_count(size, self.share / (1 - self.share)))
            if replay:
                out += self.session.solve_records(ctx, replay, self.c.solver_rollouts, "validity", trained=True,
                                                  seed=stage_seed(run_seed, ctx.iteration, f"replay-{step}"))
            return out
        return rollout

    def rollout_groups(self, ctx: StepContext, records: list[dict]) -> list[dict]:
        """One GRPO group per question: the fresh rollouts graded against the pool's pseudo-label
        (0.9·correct + 0.1·format); replayed initialisation problems get R_init, spread through
        the update (:class:`sptool.filter.pseudo_label.RolloutFilter`)."""
        from sptool.filter.pseudo_label import RolloutFilter

        stage = RolloutFilter(self.filter_options(RolloutFilter.Options), recipe=self.name,
                              advantage=self.advantage, seed=ctx.seed)
        return ctx.run_stage(stage, records)


class RQuest(RZero):
    """R-Quest (§3): R-Zero's round with a validity gate before the vote and a novelty gate
    before the questioner's reward, after a validity initialisation of the solver (iteration 0),
    replaying that task in every solver update."""

    name = "rquest"
    Config = RQuestConfig
    Filter = RQuestFilter
    prompt_roles = ("solve", "validity", "questioner", "novelty")
    prelude_name = "validity initialisation"

    def __init__(self, config: dict, session) -> None:
        super().__init__(config, session)
        self._init_data: list[dict] | None = None

    def prelude(self) -> list[Step]:
        """Iteration 0, the validity initialisation (Table 6): ``init_steps`` solver updates on
        the labelled set; the last checkpoint starts the self-play solver."""
        if not self.runs_validity_init():
            return []
        steps: list[Step] = []
        for step in range(1, self.c.init_steps + 1):
            steps += self.train_validity_init(step)
        return steps

    def plan(self, iteration: int) -> list[Step]:
        steps: list[Step] = []
        for p in self.questioner_updates():                   # 1. the questioner learns
            steps += self.propose(p, self.c.questions, trained=True)
            steps += self.judge_validity(p, after=f"{p}challenge")
            steps += self.vote(p, after=f"{p}verify-validity", only=passes_the_validity_gate)
            steps += self.judge_novelty(p, after=f"{p}verify")
            steps += self.train_questioner(p, after=f"{p}novelty")
        steps += self.propose("s-", self.c.solver_questions, trained=False)   # 2. the round's pool
        steps += self.judge_validity("s-", after="s-challenge")
        steps += self.vote("s-", after="s-verify-validity", only=passes_the_validity_gate)
        steps += self.pool_of("s-", after="s-verify")
        for step in range(1, self.c.solver_steps + 1):      # 3. the solver learns (with replay)
            steps += self.train_solver(step)
        return steps

    # -- the gates and the initialisation, each a list of steps ---------------------------------

    def judge_validity(self, p: str, after: str) -> list[Step]:
        """u(q): the solver judges each parsed question ``validity_samples`` times in validity
        mode (it may answer INVALID); the share of INVALID answers is u."""
        return [Step(f"{p}solve-validity", self.session.solve(self.c.validity_samples, "validity"),
                     inputs=[after], only=marked_valid, kind="solve"),
                Step(f"{p}verify-validity", self.session.verify(pseudo_label=True),
                     inputs=[f"{p}solve-validity"], only=has_samples, kind="verify")]

    def judge_novelty(self, p: str, after: str) -> list[Step]:
        """The frozen judge compares each question with ``novelty_k`` others of the batch."""
        return [Step(f"{p}novelty", self.novelty, inputs=[after], kind="novelty")]

    def train_validity_init(self, step: int) -> list[Step]:
        """Initialisation update ``step``: a batch of the labelled set, validity-mode answers,
        R_init groups, the update (the last one restarts the solver from its checkpoint)."""
        p = f"init{step}-"
        return [Step(f"{p}solve", self.init_solve(step), kind="solve"),
                Step(f"{p}verify", self.session.verify(pseudo_label=False), inputs=[f"{p}solve"],
                     only=has_samples, kind="verify"),
                Step(f"{p}filter", self.validity_groups, inputs=[f"{p}verify"], kind="filter"),
                Step(f"{p}train", self.session.train(["solver"], checkpoints="solver-init",
                                          restart=step == self.c.init_steps),
                     inputs=[f"{p}filter"], kind="train")]

    def runs_validity_init(self) -> bool:
        """The phase runs unless switched off, or the user brings a solver (``model.solver``)."""
        return (self.c.validity_init and not self.settings.model.solver
                and not self.settings.train.shared_policy)

    @property
    def share(self) -> float:
        return self.c.replay_share

    # -- step bodies ----------------------------------------------------------------------------

    def novelty(self, ctx: StepContext, records: list[dict]) -> list[dict]:
        from sptool.stages.novelty import LexicalJudge, NoveltyStage

        judge = (LexicalJudge(self.c.novelty_similarity, self.c.novelty_mask_numbers)
                 if self.c.novelty_judge == "lexical" else self.session.judge)
        stage = NoveltyStage(judge, k=self.c.novelty_k, seed=ctx.seed,
                             max_new_tokens=self.c.novelty_max_tokens, prompt=self.session.prompt("novelty"))
        return ctx.run_stage(stage, records)

    def init_data(self) -> list[dict]:
        """The labelled validity-initialisation set (``answer`` INVALID for a flawed problem)."""
        if self._init_data is None:
            from sptool.stages.problemsets import read_labelled_problems

            self._init_data = read_labelled_problems(self.c.init_data, "R-Quest's validity initialisation")
        return self._init_data

    def init_solve(self, step: int):
        """Initialisation step ``step``: ``init_batch`` problems (walking seeded permutations of
        the set), ``init_samples`` validity-mode answers each at top-p ``init_top_p``."""
        def solve(ctx: StepContext, records: list[dict]) -> list[dict]:
            data = self.init_data()
            run_seed = self.settings.run.seed
            chosen = walk(data, min(self.c.init_batch, len(data)), step - 1,
                          lambda epoch: stage_seed(run_seed, 0, f"init-epoch-{epoch}"))
            return self.session.solve_records(ctx, [dict(r) for r in chosen], self.c.init_samples,
                                              "validity", trained=True, top_p=self.c.init_top_p)
        return solve

    def validity_groups(self, ctx: StepContext, records: list[dict]) -> list[dict]:
        """R_init groups: 1 for a right answer or a right INVALID, −0.5 for rejecting a valid
        problem, −0.1 for an empty box, else 0."""
        from sptool.filter.pseudo_label import ValidityInitFilter

        return ctx.run_stage(ValidityInitFilter(advantage=self.advantage, seed=ctx.seed), records)

    def replay_problems(self, ctx: StepContext, step: int, count: int) -> list[dict]:
        """``count`` replayed initialisation problems for solver step ``step``, walking seeded
        permutations of the whole set across every solver step of the run."""
        if not count:
            return []
        data = self.init_data()
        count = min(count, len(data))
        position = (ctx.iteration - 1) * self.c.solver_steps + step - 1
        run_seed = self.settings.run.seed
        chosen = walk(data, count, position, lambda epoch: stage_seed(run_seed, 0, f"replay-epoch-{epoch}"))
        return [{**record, "replay": True} for record in chosen]
