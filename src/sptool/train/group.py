"""The training-group record (``filter`` writes it, ``train-step`` reads it) and which groups an
update takes."""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

from sptool.core.records import Field, InputError, RecordKind, describe


def _check_prompt(value: Any) -> str | None:
    if isinstance(value, str):
        return None if value else "expected a non-empty string or a list of chat messages"
    if not value:
        return "expected a non-empty list of chat messages"
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str) \
                or not isinstance(message.get("role"), str):
            return f"expected chat messages {{role, content}}, item {i} is {describe(message)}"
    return None


def _check_stop_strings(value: list) -> str | None:
    for i, item in enumerate(value):
        if item is not None and not isinstance(item, str):
            return f"expected a string or null per completion, item {i} is {describe(item)}"
    return None


def _check_strings(value: list) -> str | None:
    if not value:
        return "expected a non-empty list of strings"
    for i, item in enumerate(value):
        if not isinstance(item, str):
            return f"expected a list of strings, item {i} is {describe(item)}"
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_numbers(value: list) -> str | None:
    for i, item in enumerate(value):
        if not _is_number(item):
            return f"expected a list of finite numbers, item {i} is {describe(item)}"
    return None


def _check_token_id_lists(value: list) -> str | None:
    for i, ids in enumerate(value):
        if not isinstance(ids, list) or not all(type(t) is int and t >= 0 for t in ids):
            return f"completion {i}: expected a list of non-negative integer token ids"
    return None


def _check_logprob_lists(value: list) -> str | None:
    for i, item in enumerate(value):
        if item is None:
            continue
        if not isinstance(item, list) or any(not _is_number(x) for x in item):
            return f"expected a list of per-token number lists (or null), item {i} is {describe(item)}"
        positive = next((x for x in item if x > 0), None)
        if positive is not None:
            return (f"expected log-probabilities (numbers <= 0), item {i} holds {positive!r} "
                    "(a probability above 1)")
    return None


class TrainingGroupKind(RecordKind):
    """A training group; besides field types, every per-completion list has one entry per completion."""

    def validate(self, record: Any) -> dict:
        record = super().validate(record)
        n = len(record["completions"])
        for name in ("rewards", "advantages", "old_logprobs", "finish_reasons"):
            value = record.get(name)
            if value is not None and len(value) != n:
                raise InputError(f"expected {n} entries (one per completion), got {len(value)}", field=name)
        for i, reason in enumerate(record.get("finish_reasons") or []):
            if reason not in ("stop", "length"):
                raise InputError(f"expected 'stop' or 'length', item {i} is {describe(reason)}",
                                 field="finish_reasons")
        return record


TRAINING_GROUP = TrainingGroupKind("training group", (
    Field("prompt", (str, list), check=_check_prompt,
          help="chat messages (or plain text for base models), exactly as generation saw them"),
    Field("completions", (list,), check=_check_strings, help="the sampled completion texts"),
    Field("rewards", (list,), check=_check_numbers, help="one reward per completion"),
    Field("role", (str,), required=False, help="solver, challenger, questioner, synthesis, validity"),
    Field("advantages", (list,), required=False, nullable=True, check=_check_numbers),
    Field("old_logprobs", (list,), required=False, nullable=True, check=_check_logprob_lists),
    Field("completion_ids", (list,), required=False, nullable=True, check=_check_token_id_lists,
          help="each completion's sampled token ids (trained as sampled, not re-tokenised)"),
    Field("finish_reasons", (list,), required=False, nullable=True,
          help="'stop' (EOS appended) or 'length' per completion; default stop"),
    Field("stop_strings", (list,), required=False, nullable=True, check=_check_stop_strings,
          help="per completion, the stop string that ended it (no EOS appended) or null"),
))


def group_role(record: dict) -> str:
    return str(record.get("role") or "policy")


def split_updates(groups: list[dict], groups_per_update: int | None) -> list[list[dict]]:
    """All groups in one update (default), or consecutive chunks of ``groups_per_update`` groups."""
    if not groups_per_update or groups_per_update >= len(groups):
        return [groups]
    return [groups[i:i + groups_per_update] for i in range(0, len(groups), groups_per_update)]


def select_roles(groups: Iterable[dict], roles: list[str] | None, on_skip: Callable[[dict], None]) -> list[dict]:
    selected = []
    for group in groups:
        if roles and group_role(group) not in roles:
            on_skip(group)
            continue
        selected.append(group)
    return selected
