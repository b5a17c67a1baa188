"""R-Zero's and R-Quest's filters (R-Quest §2-3): questioner groups and majority-pseudo-label solver
groups, per batch of ``batch_size`` records (a ``group_id`` is never split).

- R-Zero (§2.1): questioner reward r = uncertainty(p) − BLEU-cluster repetition penalty (−1 for
  an unparsable question), p = ``majority_frac``; solver groups for p in the band with a
  non-empty majority, pseudo-label = majority, reward (1 − w)·correct + w·format (w = 0.1).
- R-Quest (§3) overrides one hook, :meth:`RZeroFilter.score`: the reward comes from the validity
  gate u (``verdicts.validity.invalid_frac``), s (``verdicts.math.majority_frac``) and the novelty
  gate (``novelty.novel``); no repetition penalty. ``replay`` (records of the solved and verified
  validity-initialisation set) adds validity groups making up ``replay_share`` of the solver-side
  groups.
- Validity initialisation (:class:`ValidityInitFilter`): a labelled validity set, solved in
  validity mode and verified, becomes validity groups with R-Quest's R_init reward.
- A solver step of ``sptool run`` (:class:`RolloutFilter`): fresh rollouts of pool questions,
  graded against the pool's majority pseudo-label, become solver groups (no band: the pool was
  banded by the voting samples); replayed initialisation problems become validity groups, spread
  through the update.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from sptool import rewards as R
from sptool.filter.groups import (TrainingGroupFilter, contiguous_batches, finish_reasons_of,
                                  generation_prompt, has_boxed_answer, is_parsed, sample_logprobs, sample_token_ids,
                                  samples_of, stop_strings_of, verdict, verify_error_of)
from sptool.core.records import InputError, content_id
from sptool.settings import setting


@dataclass
class PseudoLabelOptions:
    """What R-Zero and R-Quest share: the batch, the solver band and the solver reward."""

    batch_size: int = setting(512, "records per filter batch: the BLEU repetition penalty and the "
                              "questioner groups are computed per batch (a group_id is never split)",
                              "R-Zero: rollout batch 512", minimum=1)
    solver_band: tuple[float, float] = setting(
        R.RZERO_SOLVER_BAND, "keep solver data with LOW <= majority agreement <= HIGH",
        "R-Zero §2.1; R-Quest §3 \"保留 s(q) 在 [0.3, 0.8]\"", band=True)
    format_weight: float = setting(R.PSEUDO_LABEL_FORMAT_WEIGHT, "solver reward (1 − w)·correct + "
                                   "w·format (a boxed answer) against the majority pseudo-label", "R-Quest: 0.9 + 0.1 格式分",
                                   minimum=0, maximum=1)


@dataclass
class RZeroOptions(PseudoLabelOptions):
    uncertainty: str = setting("paper", "questioner uncertainty: paper 1 − 2|p − ½| or reference "
                               "min(p, 1 − p)", "WIST App. D (R-Zero)", choices=("paper", "reference"))
    bleu_threshold: float = setting(R.BLEU_DISTANCE_THRESHOLD, "distance threshold on 1 − BLEU for "
                                    "the repetition-penalty clusters", "R-Zero (reference code)")
    bleu_pairing: str = setting("mean", "mean (symmetric BLEU) or reference (R-Zero's code: the "
                                "hypothesis is the earlier question)", "R-Zero code",
                                choices=("mean", "reference"))
    clip_questioner_reward: bool = setting(False, "max(0, uncertainty − penalty) as in the R-Zero "
                                           "paper (its code does not clip)", "R-Zero paper")


@dataclass
class RQuestOptions(PseudoLabelOptions):
    replay_share: float = setting(0.1, "share of the solver-side groups that are replayed validity-"
                                  "initialisation groups (sptool run: in every solver update)", "R-Quest §3 \"混入 solver 数据的 10%\"", minimum=0, below=1)


@dataclass
class Scored:
    """A parsed question's questioner reward (None: set per batch) and the agreement (p or s)
    that decides its solver group (None: no solver group)."""

    record: dict
    agreement: Any = None
    reward: float | None = None
    terms: dict = field(default_factory=dict)


class RZeroFilter(TrainingGroupFilter):
    recipe = "rzero"
    Options: type = RZeroOptions
    agreement = "p"                       # the agreement's name in reject reasons (R-Quest: s)
    options: RZeroOptions

    def __init__(self, options: PseudoLabelOptions | None = None, *, questioner: bool = True, **common: Any):
        super().__init__(options, **common)
        self.solver_side_groups = 0           # solver groups so far (R-Quest's replay share)
        self.questioner = questioner          # False: solver groups only (a round's solver pool)

    def score(self, record: dict) -> Scored | None:
        """R-Zero: a question with a math verdict; its reward waits for the batch's BLEU penalty."""
        p = verdict(record, "math", "majority_frac")
        if p is None or not samples_of(record):
            self.drop(record, "question without a verdict (run solve | verify)")
            return None
        return Scored(record, agreement=p)

    def penalise_repetition(self, scored: list[Scored]) -> None:
        """r = uncertainty(p) − r_rep over the batch's questions still without a reward."""
        o = self.options
        waiting = [s for s in scored if s.reward is None]
        penalties = R.bleu_repetition_penalties([s.record["question"] for s in waiting],
                                                o.bleu_threshold, o.bleu_pairing) if waiting else []
        for s, penalty in zip(waiting, penalties):
            p = float(s.agreement)
            s.reward = R.rzero_questioner_reward(p, penalty, True, o.uncertainty, o.clip_questioner_reward)
            s.terms = {"p": p, "uncertainty": R.uncertainty_reward(p, o.uncertainty),
                       "repetition_penalty": penalty}

    def process(self, records: Iterator[dict]) -> Iterator[dict]:
        for batch in contiguous_batches(records, self.options.batch_size, lambda r: r.get("group_id")):
            batch = self.without_verify_errors(batch)
            rewards, terms, scored = {}, {}, []
            for record in batch:
                if not is_parsed(record):
                    rewards[id(record)] = R.FORMAT_FAILURE_REWARD
                    terms[id(record)] = {"format_failure": True}
                    self.drop(record, "solver: unparsable question")
                    continue
                result = self.score(record)
                if result is not None:
                    scored.append(result)
            if self.questioner:
                self.penalise_repetition(scored)
                for s in scored:
                    rewards[id(s.record)], terms[id(s.record)] = s.reward, s.terms
                yield from self.questioner_groups(batch, rewards, terms)
            for s in scored:
                if s.agreement is not None:
                    group = self.banded_solver_group(s.record, s.agreement)
                    if group is not None:
                        yield group

    def questioner_groups(self, batch: list[dict], rewards: dict[int, float],
                          terms: dict[int, dict]) -> Iterator[dict]:
        """One questioner group per ``group_id`` (else per prompt) within the batch."""
        order: dict[Any, list[dict]] = {}
        for record in batch:
            if id(record) not in rewards:
                continue
            key = record.get("group_id")
            if key is None:
                key = repr(generation_prompt(record))
            order.setdefault(key, []).append(record)
        for members in order.values():
            group = self.generator_group("questioner", members, [rewards[id(m)] for m in members],
                                         reward_terms=[terms[id(m)] for m in members])
            if group is not None:
                yield group

    def banded_solver_group(self, record: dict, agreement: Any) -> dict | None:
        """Solver data when the majority agreement (p or s) is in the solver band and the
        majority is non-empty; trained against the majority as pseudo-label."""
        band = self.options.solver_band
        majority = verdict(record, "math", "majority")
        if not R.keep_for_solver_training(agreement, majority, band):
            reason = ("solver: empty majority" if R.in_band(agreement, band)
                      else f"solver: {self.agreement} outside [{band[0]}, {band[1]}]")
            self.drop(record, reason)
            return None
        majority = str(majority)
        correct = self.correct_vs_majority(record, majority)
        group_rewards = [R.pseudo_label_solver_reward(c, has_boxed_answer(s), self.options.format_weight)
                         for c, s in zip(correct, samples_of(record))]
        group = self.solver_group(record, group_rewards, pseudo_label=majority)
        if group is not None:
            self.solver_side_groups += 1
        return group

    def correct_vs_majority(self, record: dict, majority: str) -> list[bool]:
        """Per-sample agreement with the majority pseudo-label."""
        samples = samples_of(record)
        if record.get("label_source") == "majority":
            return [bool(s.get("correct")) for s in samples]
        from sptool.stages.verify import answers_equivalent  # graded against a reference: re-grade

        self.stats.notes["re-graded against the majority (verify without --pseudo-label)"] += 1
        results = []
        for s in samples:
            answer = s.get("answer")
            results.append(answer is not None and answer != "INVALID" and (
                answers_equivalent(majority, answer) or answers_equivalent(answer, majority)))
        return results


class ValidityGroups:
    """R-Quest's validity groups: R_init on each validity-mode sample of a labelled problem."""

    @staticmethod
    def problem_is_invalid(record: dict) -> bool:
        """A labelled flawed problem: ``answer`` INVALID, or ``flawed: true``."""
        answer = record.get("answer")
        return record.get("flawed") is True or (
            isinstance(answer, str) and answer.strip().upper() == "INVALID")

    def validity_group(self: Any, record: dict) -> dict | None:
        if verify_error_of(record):
            self.drop(record, "verify_error")
            return None
        samples = samples_of(record)
        if not samples or record.get("mode") not in (None, "validity"):
            self.drop(record, "validity: needs samples from `solve --mode validity`")
            return None
        invalid = self.problem_is_invalid(record)
        rewards = [R.validity_init_reward(s.get("answer") if has_boxed_answer(s) else None,
                                          problem_invalid=invalid, correct=s.get("correct"))
                   for s in samples]
        prompt = record.get("solve_prompt")
        if not prompt:
            self.drop(record, "validity: no solve_prompt (run `sptool solve --mode validity`)")
            return None
        return self.group("validity", prompt, [s["text"] for s in samples], rewards,
                          sources=[record], group_id=record.get("group_id"),
                          old_logprobs=sample_logprobs(samples), question=record.get("question"),
                          finish_reasons=finish_reasons_of(samples), stop_strings=stop_strings_of(samples),
                          completion_ids=sample_token_ids(samples), problem_invalid=invalid)


class RQuestFilter(ValidityGroups, RZeroFilter):
    recipe = "rquest"
    Options = RQuestOptions
    agreement = "s"
    options: RQuestOptions

    def __init__(self, options: RQuestOptions | None = None, *, replay: Iterable[dict] | None = None,
                 replay_source: str = "replay", **common: Any):
        super().__init__(options, **common)
        self.replay_pool = self.replay_groups_from(replay, replay_source) if replay is not None else None

    def score(self, record: dict) -> Scored | None:
        """The validity gate u, then s and the novelty gate (R-Quest §3)."""
        u = verdict(record, "validity", "invalid_frac")
        if u is None:
            self.drop(record, "no validity verdict (solve --mode validity | verify first)")
            return None
        u = float(u)
        if not R.passes_validity_gate(u):
            self.drop(record, "solver: invalid by the validity gate (u > 1/2)")
            return Scored(record, reward=R.rquest_questioner_reward(u, None, None),
                          terms={"u": u, "g_valid": R.validity_gate(u)})
        s = verdict(record, "math", "majority_frac")
        if s is None or record.get("mode") != "math":
            self.drop(record, "passed the validity gate but has no math verdict (solve --mode math | verify)")
            return None
        novelty = record.get("novelty")
        novel = novelty.get("novel") if isinstance(novelty, dict) else None
        if novel is None:
            self.stats.notes["without a novelty verdict (taken as novel)"] += 1
        s = float(s)
        return Scored(record, agreement=s, reward=R.rquest_questioner_reward(u, s, novel),
                      terms={"u": u, "g_valid": R.validity_gate(u), "s": s,
                             "uncertainty": R.uncertainty_reward(s, "reference"), "novel": novel})

    def process(self, records: Iterator[dict]) -> Iterator[dict]:
        yield from super().process(records)
        if self.replay_pool is not None:
            yield from self.replay_groups()

    def replay_groups_from(self, records: Iterable[dict], source: str) -> list[dict]:
        """Validity groups from the solved and verified initialisation set."""
        pool = []
        for record in records:
            group = self.validity_group(record)
            if group is not None:
                self.stats.notes[f"{group['role']} groups"] -= 1  # counted when replayed
                group["replay"] = True
                pool.append(group)
        if not pool:
            raise InputError("no usable validity records (solve --mode validity | verify them first)",
                             source=source)
        return pool

    def replay_groups(self) -> Iterator[dict]:
        """Validity groups making up ``replay_share`` of the solver-side groups:
        k = round(n_solver · share / (1 − share)), drawn without replacement (seeded), cycling
        through the pool when k exceeds it."""
        share = self.options.replay_share
        n = self.solver_side_groups
        k = round(n * share / (1.0 - share)) if share > 0 else 0
        pool = list(self.replay_pool or [])
        rng = random.Random(content_id("replay", self.seed, n))
        drawn: list[dict] = []
        while len(drawn) < k:
            rng.shuffle(pool)
            drawn.extend(pool[:k - len(drawn)])
        for group in drawn:
            self.stats.notes["validity groups"] += 1
            self.stats.notes["replayed"] += 1
            yield dict(group)


class ValidityInitFilter(ValidityGroups, TrainingGroupFilter):
    """R-Quest's validity initialisation: the input is a labelled validity set, solved in
    validity mode and verified; every usable record becomes a validity group."""

    recipe = "rquest"
    Options = type(None)                  # no settings of its own

    def process(self, records: Iterator[dict]) -> Iterator[dict]:
        for record in records:
            group = self.validity_group(record)
            if group is not None:
                yield group


def interleave(major: list, minor: list) -> list:
    """``minor`` spread evenly through ``major`` (replay groups inside an update, not after it)."""
    if not minor:
        return list(major)
    step = (len(major) + 1) / (len(minor) + 1)
    positions = {round(step * (i + 1)) + i for i in range(len(minor))}
    major_items, minor_items = iter(major), iter(minor)
    out = [next(minor_items) if index in positions else next(major_items, None)
           for index in range(len(major) + len(minor))]
    return [item for item in out if item is not None] + list(minor_items)


class RolloutFilter(ValidityGroups, TrainingGroupFilter):
    """One solver step of R-Zero/R-Quest (``sptool run``): each pool question's fresh rollouts,
    verified against its ``answer`` (the round's majority pseudo-label), are one solver group with
    reward (1 − w)·correct + w·format; a replayed initialisation problem (``mode`` validity) is a
    validity group with R_init, marked ``replay``. The replay groups are spread through the
    solver groups. Of the recipe's options only ``format_weight`` applies (the pool was banded
    by the voting samples)."""

    Options = PseudoLabelOptions
    options: PseudoLabelOptions

    def __init__(self, options: PseudoLabelOptions | None = None, *, recipe: str = "rzero", **common: Any):
        super().__init__(options, **common)
        self.recipe = recipe

    def process(self, records: Iterator[dict]) -> Iterator[dict]:
        solver, replay = [], []
        for record in records:
            if verify_error_of(record):
                self.drop(record, "verify_error")
                continue
            if record.get("mode") == "validity":
                group = self.validity_group(record)
                if group is not None:
                    group["replay"] = True
                    replay.append(group)
                continue
            samples = samples_of(record)
            if not samples:
                self.drop(record, "solver: no rollouts")
                continue
            rewards = [R.pseudo_label_solver_reward(s.get("correct"), has_boxed_answer(s),
                                                    self.options.format_weight) for s in samples]
            group = self.solver_group(record, rewards, pseudo_label=record.get("answer"))
            if group is not None:
                solver.append(group)
        yield from interleave(solver, replay)
