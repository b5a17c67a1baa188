"""``filter``: turn verified records into training groups, recipe by recipe (rewards and gates).

A **training group** is what one policy-gradient group needs (DESIGN §3)::

    {"id", "role": solver|challenger|questioner|synthesis|validity, "recipe",
     "prompt": [chat messages exactly as used for generation], "completions": [texts],
     "rewards": [...], "advantages": [...], "advantage": "dr_grpo"|"grpo",
     "old_logprobs"?: [[...] per completion], "source_ids": [...], "group_id", lineage…}

Recipes (every formula lives in :mod:`sptool.rewards`):

- ``wist`` — records arrive grouped by document (``group_id``, contiguous). Challenger group: all
  G candidates, r = exp(−(Var − 0.25)²/σ) for valid QAs and ρ for invalid ones; a document whose
  valid QAs all have Var = 0 is skipped; solver group: one valid QA drawn uniformly (seeded) with
  binary correctness over its K samples (role balancing, WIST §3.4).
- ``rzero`` — per batch (``batch_size`` records, never splitting a ``group_id``): questioner
  groups with r = uncertainty(p) − BLEU-cluster repetition penalty (−1 unparsable), p =
  ``majority_frac``; solver groups for 0.3 ≤ p ≤ 0.8 with a non-empty majority, pseudo-label =
  majority, reward 0.9·correct + 0.1·format.
- ``rquest`` — questioner reward from the validity gate u (``verdicts.validity.invalid_frac``),
  s (``verdicts.math.majority_frac``) and the novelty gate (``novelty.novel``); solver groups as
  R-Zero for questions that pass the gate; ``replay`` mixes validity-initialisation groups so that
  they make up ``replay_share`` of the solver-side groups; ``validity_init`` turns a labelled
  validity set (solved in validity mode, verified) into validity groups.
- ``svs`` — original problems with 0 < Acc < 1 → solver groups; variants (``origin:
  synthesis``, contiguous by ``group_id`` = one correct solution) → a synthesis group kept only
  when some variant's accuracy is in the band, and variant solver groups with 0 < Acc < 1. With
  ``format_weight`` w > 0 (not the paper's) the solver reward is (1 − w)·correct + w·format and a
  group is kept when its rewards differ, which for w = 0 is exactly 0 < Acc < 1.

What a recipe does not use is handed to :meth:`Stage.drop` with a reason prefixed by the use it
was dropped from (``solver:``, ``synthesis:``, …), so ``--rejects`` shows every decision. A record
can be used for one role and dropped from another (an R-Zero question outside the band still
rewards its questioner).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

from sptool import rewards as R
from sptool.jsonl import read_records
from sptool.records import InputError, UsageError, content_id
from sptool.stage import Stage

RECIPES = ("wist", "rzero", "rquest", "svs")
# Solver reward (1 − w)·correct + w·format: R-Zero/R-Quest add a 0.1 format term; SvS (Eq. 4) and
# WIST (Eq. 13) use binary correctness, so their w defaults to 0.
DEFAULT_FORMAT_WEIGHT = {"rzero": 0.1, "rquest": 0.1, "svs": 0.0}
ADVANTAGES = ("dr_grpo", "grpo")
ROLES = ("solver", "challenger", "questioner", "synthesis", "validity")
# Where `challenge` keeps the exact chat messages that produced a generated question.
GENERATION_PROMPT_FIELDS = ("challenger_prompt", "questioner_prompt", "synthesis_prompt",
                            "generation_prompt")
LINEAGE_FIELDS = ("doc_id", "path_id", "leaf", "parent_id", "topic_id")


@dataclass
class FilterOptions:
    """Every knob of every recipe, with the papers' defaults."""

    advantage: str = "dr_grpo"
    batch_size: int = 512
    seed: int = 0
    # WIST
    sigma: float = R.WIST_SIGMA
    invalid_penalty: float = R.WIST_INVALID_PENALTY
    # R-Zero / R-Quest
    uncertainty: str = "paper"            # R-Zero questioner: paper 1−2|p−½| or reference min(p,1−p)
    bleu_threshold: float = R.BLEU_DISTANCE_THRESHOLD
    bleu_pairing: str = "mean"
    clip_questioner_reward: bool = False  # R-Zero paper's max(0, ·)
    solver_band: tuple[float, float] = R.RZERO_SOLVER_BAND
    format_weight: float | None = None    # solver (1−w)·correct + w·format; None: the recipe's default
    replay: str | None = None
    replay_share: float = 0.1
    validity_init: bool = False
    # SvS
    synthesis_band: tuple[float, float] = R.SVS_SYNTHESIS_BAND
    negative_synthesis: bool = False
    negative_synthesis_value: float = -1.0

    def check(self, recipe: str) -> None:
        if recipe not in RECIPES:
            from sptool.models.base import unknown_name_error
            raise unknown_name_error("recipe", recipe, list(RECIPES))
        if self.advantage not in ADVANTAGES:
            from sptool.models.base import unknown_name_error
            raise unknown_name_error("--advantage", self.advantage, list(ADVANTAGES))
        if self.batch_size < 1:
            raise UsageError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.sigma <= 0:
            raise UsageError(f"--sigma must be > 0, got {self.sigma}")
        if self.uncertainty not in ("paper", "reference"):
            raise UsageError(f"--uncertainty must be paper or reference, got '{self.uncertainty}'")
        if self.bleu_pairing not in ("mean", "reference"):
            raise UsageError(f"--bleu-pairing must be mean or reference, got '{self.bleu_pairing}'")
        if self.format_weight is None:
            self.format_weight = DEFAULT_FORMAT_WEIGHT.get(recipe, 0.0)
        if not 0 <= self.format_weight <= 1:
            raise UsageError(f"--format-weight must be in [0, 1], got {self.format_weight}")
        if not 0 <= self.replay_share < 1:
            raise UsageError(f"--replay-share must be in [0, 1), got {self.replay_share}")
        for name, band in (("--solver-band", self.solver_band),
                           ("--synthesis-band", self.synthesis_band)):
            lo, hi = band
            if not 0 <= lo <= hi <= 1:
                raise UsageError(f"{name} must be LOW,HIGH with 0 <= LOW <= HIGH <= 1, got {lo},{hi}")
        if recipe != "rquest" and (self.replay or self.validity_init):
            raise UsageError("--replay and --validity-init belong to --recipe rquest")
        if self.validity_init and self.replay:
            raise UsageError("--validity-init already emits validity groups; drop --replay")


def parse_band(text: str, option: str) -> tuple[float, float]:
    """``"0.3,0.8"`` → (0.3, 0.8), with a usage error naming the option otherwise."""
    try:
        lo, hi = (float(part) for part in text.split(","))
    except ValueError:
        raise UsageError(f"{option} must be LOW,HIGH (e.g. 0.3,0.8), got '{text}'") from None
    return lo, hi


# ---------------------------------------------------------------- record helpers

def generation_prompt(record: dict) -> list | str | None:
    """The chat messages that generated this question (challenge's ``*_prompt`` field)."""
    for key in GENERATION_PROMPT_FIELDS:
        if record.get(key):
            return record[key]
    return None


def verdict(record: dict, mode: str, key: str) -> Any:
    """A verify summary field for one pass: ``verdicts[mode][key]``, else the top-level field
    when the record's last pass was in ``mode``."""
    verdicts = record.get("verdicts")
    if isinstance(verdicts, dict) and isinstance(verdicts.get(mode), dict):
        return verdicts[mode].get(key)
    if (record.get("mode") or "math") == mode:
        return record.get(key)
    return None


def verify_error_of(record: dict) -> str | None:
    if record.get("verify_error"):
        return str(record["verify_error"])
    verdicts = record.get("verdicts")
    if isinstance(verdicts, dict):
        for summary in verdicts.values():
            if isinstance(summary, dict) and summary.get("verify_error"):
                return str(summary["verify_error"])
    return None


def is_parsed(record: dict) -> bool:
    """The generation parsed into a question (``valid`` is not false and there is a question)."""
    question = record.get("question")
    return record.get("valid") is not False and isinstance(question, str) and bool(question.strip())


def samples_of(record: dict) -> list[dict]:
    samples = record.get("samples")
    if samples is None:
        return []
    if not isinstance(samples, list) or not all(isinstance(s, dict) for s in samples):
        raise InputError("expected a list of objects (run `sptool solve`)", field="samples",
                         source=f"record {record.get('id')}")
    return samples


def has_boxed_answer(sample: dict) -> bool:
    """The format term's test: the sample's graded answer came from a ``\\boxed{}`` (``verify``
    also grades answers it finds without one, marking them ``boxed: false``)."""
    return sample.get("answer") is not None and sample.get("boxed", True) is not False


def finish_reasons_of(items: list[dict]) -> list | None:
    """Each completion's ``finish_reason`` ("stop"/"length") when every one carries it."""
    if items and all(item.get("finish_reason") in ("stop", "length") for item in items):
        return [item["finish_reason"] for item in items]
    return None


def sample_logprobs(samples: list[dict]) -> list | None:
    if samples and all(isinstance(s.get("logprobs"), list) for s in samples):
        return [s["logprobs"] for s in samples]
    return None


def contiguous_groups(records: Iterable[dict], key: Callable[[dict], Any]) -> Iterator[list[dict]]:
    """Runs of consecutive records with the same key (a None key is a group of one). A key that
    comes back after its run ended is an error: groups must be contiguous."""
    run: list[dict] = []
    closed: set = set()
    current: Any = object()
    for record in records:
        k = key(record)
        if run and (k is None or k != current):
            yield run
            if current is not None:
                closed.add(current)
            run = []
        if k is not None and k in closed:
            raise InputError(f"records of group {k!r} are not contiguous; sort the input by group_id",
                             field="group_id", source=f"record {record.get('id')}")
        run.append(record)
        current = k
    if run:
        yield run


def contiguous_batches(records: Iterable[dict], size: int,
                       key: Callable[[dict], Any]) -> Iterator[list[dict]]:
    """Batches of at least ``size`` records (fewer at the end) that never split a group."""
    batch: list[dict] = []
    for group in contiguous_groups(records, key):
        batch.extend(group)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


# ---------------------------------------------------------------- the stage

class FilterStage(Stage):
    """Verified records in, training groups out (see the module docstring for each recipe)."""

    name = "filter"

    def __init__(self, recipe: str, options: FilterOptions | None = None):
        super().__init__()
        self.options = options or FilterOptions()
        self.options.check(recipe)
        self.recipe = recipe
        self._solver_side_groups = 0
        self._replay_pool: list[dict] | None = None
        if self.options.replay:
            self._replay_pool = self._load_replay(self.options.replay)

    # ------------------------------------------------------------ building groups

    def group(self, role: str, prompt: Any, completions: list[str], rewards: list[float], *,
              sources: list[dict], group_id: Any = None, old_logprobs: list | None = None,
              finish_reasons: list | None = None, **extra: Any) -> dict:
        source_ids = [s.get("id") for s in sources]
        record = {
            "id": content_id("group", self.recipe, role, source_ids, prompt, completions),
            "role": role,
            "recipe": self.recipe,
            "prompt": prompt,
            "completions": completions,
            "rewards": rewards,
            "advantages": R.group_advantages(rewards, self.options.advantage),
            "advantage": self.options.advantage,
        }
        if old_logprobs is not None:
            record["old_logprobs"] = old_logprobs
        if finish_reasons is not None and len(finish_reasons) == len(completions):
            # train-step appends EOS only to completions that stopped, not to truncated ones
            record["finish_reasons"] = finish_reasons
        record["source_ids"] = source_ids
        record["group_id"] = group_id
        for key in LINEAGE_FIELDS:
            values = {s.get(key) for s in sources if s.get(key) is not None}
            if len(values) == 1:
                record[key] = values.pop()
        record.update(extra)
        self.stats.notes[f"{role} groups"] += 1
        return record

    def solver_group(self, record: dict, rewards: list[float], **extra: Any) -> dict | None:
        """A solver group over the record's samples (prompt = ``solve_prompt``)."""
        prompt = record.get("solve_prompt")
        if not prompt:
            self.drop(record, "solver: no solve_prompt (run `sptool solve`)")
            return None
        samples = samples_of(record)
        return self.group("solver", prompt, [s["text"] for s in samples], rewards,
                          sources=[record], group_id=record.get("group_id"),
                          old_logprobs=sample_logprobs(samples), question=record.get("question"),
                          finish_reasons=finish_reasons_of(samples), **extra)

    def generator_group(self, role: str, members: list[dict], rewards: list[float],
                        **extra: Any) -> dict | None:
        """A challenger/questioner/synthesis group: one prompt, each member's ``raw`` output."""
        prompts = [generation_prompt(m) for m in members]
        if not members or any(p is None for p in prompts) or any(
                not isinstance(m.get("raw"), str) for m in members):
            self.stats.notes[f"{role} groups skipped (no generating prompt or raw output)"] += 1
            return None
        if any(p != prompts[0] for p in prompts[1:]):
            raise InputError(f"the {role} outputs of group {members[0].get('group_id')!r} come "
                             "from different prompts; give each prompt its own group_id",
                             field="group_id", source=f"record {members[0].get('id')}")
        logprobs = ([m["logprobs"] for m in members]
                    if all(isinstance(m.get("logprobs"), list) for m in members) else None)
        return self.group(role, prompts[0], [m["raw"] for m in members], rewards, sources=members,
                          group_id=members[0].get("group_id"), old_logprobs=logprobs,
                          finish_reasons=finish_reasons_of(members), **extra)

    def _without_verify_errors(self, records: list[dict]) -> list[dict]:
        kept = []
        for record in records:
            error = verify_error_of(record)
            if error:
                self.drop(record, "verify_error")
            else:
                kept.append(record)
        return kept

    # ------------------------------------------------------------ dispatch

    def process(self, records: Iterator[dict]) -> Iterator[dict]:
        if self.recipe == "rquest" and self.options.validity_init:
            yield from self.process_validity_init(records)
            return
        handler = {"wist": self.process_wist, "rzero": self.process_rzero,
                   "rquest": self.process_rquest, "svs": self.process_svs}[self.recipe]
        yield from handler(records)
        if self._replay_pool is not None:
            yield from self.replay_groups()

    # ------------------------------------------------------------ WIST

    def process_wist(self, records: Iterator[dict]) -> Iterator[dict]:
        o = self.options
        for document in contiguous_groups(records, lambda r: r.get("group_id")):
            candidates = self._without_verify_errors(document)
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
            rng = random.Random(content_id("wist-solver", o.seed, document[0].get("group_id"),
                                           [r.get("id") for r in valid]))
            chosen = valid[rng.randrange(len(valid))]
            rewards = [R.binary_correctness_reward(s.get("correct")) for s in samples_of(chosen)]
            group = self.solver_group(chosen, rewards)
            if group is not None:
                yield group
            for record in valid:
                if record is not chosen:
                    self.drop(record, "solver: not the QA drawn for role balancing")

    # ------------------------------------------------------------ R-Zero and R-Quest

    def _correct_vs_majority(self, record: dict, majority: str) -> list[bool]:
        """Per-sample agreement with the majority pseudo-label."""
        samples = samples_of(record)
        if record.get("label_source") == "majority":
            return [bool(s.get("correct")) for s in samples]
        from sptool.verify import answers_equivalent  # graded against a reference: re-grade

        self.stats.notes["re-graded against the majority (verify without --pseudo-label)"] += 1
        results = []
        for s in samples:
            answer = s.get("answer")
            results.append(answer is not None and answer != "INVALID" and (
                answers_equivalent(majority, answer) or answers_equivalent(answer, majority)))
        return results

    def _pseudo_label_solver_group(self, record: dict, majority: str) -> dict | None:
        correct = self._correct_vs_majority(record, majority)
        rewards = [R.pseudo_label_solver_reward(c, has_boxed_answer(s), self.options.format_weight)
                   for c, s in zip(correct, samples_of(record))]
        group = self.solver_group(record, rewards, pseudo_label=majority)
        if group is not None:
            self._solver_side_groups += 1
        return group

    def _questioner_groups(self, batch: list[dict], rewards: dict[int, float],
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

    def process_rzero(self, records: Iterator[dict]) -> Iterator[dict]:
        o = self.options
        for batch in contiguous_batches(records, o.batch_size, lambda r: r.get("group_id")):
            batch = self._without_verify_errors(batch)
            parsed, rewards, terms = [], {}, {}
            for record in batch:
                if not is_parsed(record):
                    rewards[id(record)] = R.FORMAT_FAILURE_REWARD
                    terms[id(record)] = {"format_failure": True}
                    self.drop(record, "solver: unparsable question")
                elif verdict(record, "math", "majority_frac") is None or not samples_of(record):
                    self.drop(record, "question without a verdict (run solve | verify)")
                else:
                    parsed.append(record)
            penalties = R.bleu_repetition_penalties([r["question"] for r in parsed],
                                                    o.bleu_threshold, o.bleu_pairing)
            for record, penalty in zip(parsed, penalties):
                p = float(verdict(record, "math", "majority_frac"))
                rewards[id(record)] = R.rzero_questioner_reward(
                    p, penalty, True, o.uncertainty, o.clip_questioner_reward)
                terms[id(record)] = {"p": p, "uncertainty": R.uncertainty_reward(p, o.uncertainty),
                                     "repetition_penalty": penalty}
            yield from self._questioner_groups(batch, rewards, terms)
            for record in parsed:
                group = self._banded_solver_group(record, verdict(record, "math", "majority_frac"), "p")
                if group is not None:
                    yield group

    def _banded_solver_group(self, record: dict, agreement: float | None, symbol: str) -> dict | None:
        """R-Zero/R-Quest solver data: kept when the majority agreement (p or s) is in the solver
        band and the majority is non-empty; trained against the majority as pseudo-label."""
        band = self.options.solver_band
        majority = verdict(record, "math", "majority")
        if not R.keep_for_solver_training(agreement, majority, band):
            reason = ("solver: empty majority" if R.in_band(agreement, band)
                      else f"solver: {symbol} outside [{band[0]}, {band[1]}]")
            self.drop(record, reason)
            return None
        return self._pseudo_label_solver_group(record, str(majority))

    def process_rquest(self, records: Iterator[dict]) -> Iterator[dict]:
        o = self.options
        for batch in contiguous_batches(records, o.batch_size, lambda r: r.get("group_id")):
            batch = self._without_verify_errors(batch)
            rewards, terms, solver_candidates = {}, {}, []
            for record in batch:
                if not is_parsed(record):
                    rewards[id(record)] = R.FORMAT_FAILURE_REWARD
                    terms[id(record)] = {"format_failure": True}
                    self.drop(record, "solver: unparsable question")
                    continue
                u = verdict(record, "validity", "invalid_frac")
                if u is None:
                    self.drop(record, "no validity verdict (solve --mode validity | verify first)")
                    continue
                u = float(u)
                if not R.passes_validity_gate(u):
                    rewards[id(record)] = R.rquest_questioner_reward(u, None, None)
                    terms[id(record)] = {"u": u, "g_valid": R.validity_gate(u)}
                    self.drop(record, "solver: invalid by the validity gate (u > 1/2)")
                    continue
                s = verdict(record, "math", "majority_frac")
                if s is None or record.get("mode") != "math":
                    self.drop(record, "passed the validity gate but has no math verdict "
                                      "(solve --mode math | verify)")
                    continue
                novelty = record.get("novelty")
                novel = novelty.get("novel") if isinstance(novelty, dict) else None
                if novel is None:
                    self.stats.notes["without a novelty verdict (taken as novel)"] += 1
                s = float(s)
                rewards[id(record)] = R.rquest_questioner_reward(u, s, novel)
                terms[id(record)] = {"u": u, "g_valid": R.validity_gate(u), "s": s,
                                     "uncertainty": R.uncertainty_reward(s, "reference"),
                                     "novel": novel}
                solver_candidates.append((record, s))
            yield from self._questioner_groups(batch, rewards, terms)
            for record, s in solver_candidates:
                group = self._banded_solver_group(record, s, "s")
                if group is not None:
                    yield group

    # ------------------------------------------------------------ R-Quest validity initialisation

    @staticmethod
    def problem_is_invalid(record: dict) -> bool:
        """A labelled flawed problem: ``answer`` INVALID, or ``flawed: true``."""
        answer = record.get("answer")
        return record.get("flawed") is True or (
            isinstance(answer, str) and answer.strip().upper() == "INVALID")

    def validity_group(self, record: dict) -> dict | None:
        """A validity-role group: R-Quest's R_init reward on each validity-mode sample."""
        error = verify_error_of(record)
        if error:
            self.drop(record, "verify_error")
            return None
        samples = samples_of(record)
        if not samples or record.get("mode") not in (None, "validity"):
            self.drop(record, "validity: needs samples from `solve --mode validity`")
            return None
        invalid = self.problem_is_invalid(record)
        rewards = [R.validity_init_reward(s.get("answer") if has_boxed_answer(s) else None,
                                          problem_invalid=invalid,
                                          correct=s.get("correct"))
                   for s in samples]
        prompt = record.get("solve_prompt")
        if not prompt:
            self.drop(record, "validity: no solve_prompt (run `sptool solve --mode validity`)")
            return None
        return self.group("validity", prompt, [s["text"] for s in samples], rewards,
                          sources=[record], group_id=record.get("group_id"),
                          old_logprobs=sample_logprobs(samples), question=record.get("question"),
                          problem_invalid=invalid)

    def process_validity_init(self, records: Iterator[dict]) -> Iterator[dict]:
        for record in records:
            group = self.validity_group(record)
            if group is not None:
                yield group

    def _load_replay(self, path: str) -> list[dict]:
        """Validity groups from the replay file (the solved and verified initialisation set)."""
        pool = []
        for record in read_records(path):
            group = self.validity_group(record)
            if group is not None:
                self.stats.notes[f"{group['role']} groups"] -= 1  # counted when replayed
                group["replay"] = True
                pool.append(group)
        if not pool:
            raise InputError("no usable validity records (solve --mode validity | verify them first)",
                             source=path)
        return pool

    def replay_groups(self) -> Iterator[dict]:
        """Validity groups making up ``replay_share`` of the solver-side groups:
        k = round(n_solver · share / (1 − share)), drawn without replacement (seeded), cycling
        through the pool when k exceeds it."""
        share = self.options.replay_share
        n = self._solver_side_groups
        k = round(n * share / (1.0 - share)) if share > 0 else 0
        pool = list(self._replay_pool or [])
        rng = random.Random(content_id("replay", self.options.seed, n))
        drawn: list[dict] = []
        while len(drawn) < k:
            rng.shuffle(pool)
            drawn.extend(pool[:k - len(drawn)])
        for group in drawn:
            self.stats.notes["validity groups"] += 1
            self.stats.notes["replayed"] += 1
            yield dict(group)

    # ------------------------------------------------------------ SvS

    @staticmethod
    def is_variant(record: dict) -> bool:
        return record.get("origin") == "synthesis" or bool(record.get("synthesis_prompt"))

    def _svs_solver(self, record: dict, what: str) -> dict | None:
        # w = 0: the binary reward of SvS Eq. 4, and "rewards differ" is Algorithm 1's 0 < Acc < 1
        weight = self.options.format_weight
        rewards = [R.pseudo_label_solver_reward(s.get("correct"), has_boxed_answer(s), weight)
                   for s in samples_of(record)]
        if not R.rewards_differ(rewards):
            self.drop(record, f"solver: {what} Acc is 0 or 1" if not weight else
                      f"solver: {what} rewards all equal (same correctness and format)")
            return None
        group = self.solver_group(record, rewards, variant=what == "variant")
        if group is not None:
            self._solver_side_groups += 1
        return group

    def process_svs(self, records: Iterator[dict]) -> Iterator[dict]:
        o = self.options

        def key(record: dict) -> Any:
            if not self.is_variant(record):
                return None
            return ("variants", record.get("group_id") or record.get("parent_id"))

        for run in contiguous_groups(records, key):
            if not self.is_variant(run[0]):
                for record in self._without_verify_errors(run):
                    if record.get("p_hat") is None or not samples_of(record):
                        self.drop(record, "question without a verdict (run solve | verify)")
                        continue
                    group = self._svs_solver(record, "original")
                    if group is not None:
                        yield group
                continue
            variants = self._without_verify_errors(run)
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
                group = self._svs_solver(record, "variant")
                if group is not None:
                    yield group
