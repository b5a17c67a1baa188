"""The training-group builder every recipe's filter shares, and its record helpers.

A **training group** is what one policy-gradient group needs (docs/architecture.md, record kinds)::

    {"id", "role": solver|challenger|questioner|synthesis|validity, "recipe",
     "prompt": [chat messages exactly as used for generation], "completions": [texts],
     "rewards": [...], "advantages": [...], "advantage": "dr_grpo"|"grpo",
     "old_logprobs"?: [[...] per completion], "source_ids": [...], "group_id", lineage…}

What a filter does not use is handed to :meth:`Stage.drop` with a reason prefixed by the use it
was dropped from (``solver:``, ``synthesis:``, …), so ``--rejects`` shows every decision. A record
can be used for one role and dropped from another (an R-Zero question outside the band still
rewards its questioner).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

from sptool import rewards as R
from sptool.core.records import InputError, content_id, record_error
from sptool.settings import check_ranges
from sptool.core.stage import Stage

ADVANTAGES = ("dr_grpo", "grpo")
ROLES = ("solver", "challenger", "questioner", "synthesis", "validity")
# Where `challenge` keeps the exact chat messages that produced a generated question.
GENERATION_PROMPT_FIELDS = ("challenger_prompt", "questioner_prompt", "synthesis_prompt",
                            "generation_prompt")
LINEAGE_FIELDS = ("doc_id", "path_id", "leaf", "parent_id", "topic_id")


def option_label(name: str) -> str:
    """The ``sptool filter`` flag of an options field, for error messages."""
    return "--" + name.replace("_", "-")


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
        raise record_error("expected a list of objects (run `sptool solve`)", record, field="samples")
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


def stop_strings_of(items: list[dict]) -> list | None:
    """Each completion's ``stop_string`` (or None) when any ended at a stop string: train-step
    appends no EOS to those (the sampler never emitted one)."""
    if any(item.get("stop_string") for item in items):
        return [item.get("stop_string") for item in items]
    return None


def sample_token_ids(samples: list[dict]) -> list | None:
    """Each sample's sampled token ids (kept beside its log-probs), when every sample has them:
    train-step trains those tokens instead of re-tokenising the text, which at temperature 1 often
    splits differently (``"ans","wer"`` sampled, ``"answer"`` re-tokenised) and would misalign the log-probs."""
    if samples and all(isinstance(s.get("token_ids"), list) and isinstance(s.get("logprobs"), list)
                       and len(s["token_ids"]) == len(s["logprobs"]) for s in samples):
        return [s["token_ids"] for s in samples]
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
            raise record_error(f"records of group {k!r} are not contiguous; sort the input by group_id",
                               record, field="group_id")
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


# ---------------------------------------------------------------- the builder

class TrainingGroupFilter(Stage):
    """Base of every recipe's filter: verified records in, training groups out.

    ``Options`` is the recipe's options dataclass (its fields are the recipe's filter settings,
    shared with the recipe's configuration section); ``advantage`` (dr_grpo or grpo) follows the
    trainer's loss and ``seed`` makes any draw reproducible.
    """

    name = "filter"
    recipe = ""
    Options: type = type(None)

    def __init__(self, options: Any = None, *, advantage: str = "dr_grpo", seed: int = 0):
        super().__init__()
        if advantage not in ADVANTAGES:
            from sptool.core.registry import unknown_name_error
            raise unknown_name_error("--advantage", advantage, list(ADVANTAGES))
        self.options = options if options is not None else self.Options()
        if self.options is not None:
            check_ranges(self.options, option_label)
        self.advantage, self.seed = advantage, seed

    def group(self, role: str, prompt: Any, completions: list[str], rewards: list[float], *,
              sources: list[dict], group_id: Any = None, old_logprobs: list | None = None,
              finish_reasons: list | None = None, stop_strings: list | None = None,
              completion_ids: list | None = None, **extra: Any) -> dict:
        source_ids = [s.get("id") for s in sources]
        record = {
            "id": content_id("group", self.recipe, role, source_ids, prompt, completions),
            "role": role,
            "recipe": self.recipe,
            "prompt": prompt,
            "completions": completions,
            "rewards": rewards,
            "advantages": R.group_advantages(rewards, self.advantage),
            "advantage": self.advantage,
        }
        if old_logprobs is not None:
            record["old_logprobs"] = old_logprobs
        if completion_ids is not None and len(completion_ids) == len(completions):
            record["completion_ids"] = completion_ids
        if finish_reasons is not None and len(finish_reasons) == len(completions):
            # train-step appends EOS only to completions that stopped, not to truncated ones
            record["finish_reasons"] = finish_reasons
        if stop_strings is not None and len(stop_strings) == len(completions):
            record["stop_strings"] = stop_strings
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
                          finish_reasons=finish_reasons_of(samples), stop_strings=stop_strings_of(samples),
                          completion_ids=sample_token_ids(samples), **extra)

    def generator_group(self, role: str, members: list[dict], rewards: list[float],
                        **extra: Any) -> dict | None:
        """A challenger/questioner/synthesis group: one prompt, each member's ``raw`` output."""
        prompts = [generation_prompt(m) for m in members]
        if not members or any(p is None for p in prompts) or any(
                not isinstance(m.get("raw"), str) for m in members):
            self.stats.notes[f"{role} groups skipped (no generating prompt or raw output)"] += 1
            return None
        if any(p != prompts[0] for p in prompts[1:]):
            raise record_error(f"the {role} outputs of group {members[0].get('group_id')!r} come "
                               "from different prompts; give each prompt its own group_id",
                               members[0], field="group_id")
        logprobs = ([m["logprobs"] for m in members]
                    if all(isinstance(m.get("logprobs"), list) for m in members) else None)
        return self.group(role, prompts[0], [m["raw"] for m in members], rewards, sources=members,
                          group_id=members[0].get("group_id"), old_logprobs=logprobs,
                          finish_reasons=finish_reasons_of(members), stop_strings=stop_strings_of(members),
                          **extra)

    def graded_solver_group(self, record: dict, format_weight: float, *, what: str = "",
                            keep_equal: bool = False, **extra: Any) -> dict | None:
        """A solver group graded against the reference answer: (1 − w)·correct + w·format per
        sample (w = 0: SvS Eq. 4's binary reward); dropped when its rewards are all equal (SvS
        Algorithm 1's 0 < Acc < 1) unless ``keep_equal``."""
        rewards = [R.pseudo_label_solver_reward(s.get("correct"), has_boxed_answer(s), format_weight)
                   for s in samples_of(record)]
        if not keep_equal and not R.rewards_differ(rewards):
            prefix = f"solver: {what} " if what else "solver: "
            self.drop(record, f"{prefix}Acc is 0 or 1" if not format_weight else
                      f"{prefix}rewards all equal (same correctness and format)")
            return None
        return self.solver_group(record, rewards, **extra)

    def without_verify_errors(self, records: list[dict]) -> list[dict]:
        kept = []
        for record in records:
            if verify_error_of(record):
                self.drop(record, "verify_error")
            else:
                kept.append(record)
        return kept
