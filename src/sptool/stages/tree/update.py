"""``posterior update``: learnability observations fed back into the tree (WIST §3.5)."""

from __future__ import annotations

import json
import math
from typing import Iterator

from sptool.core.records import Field, InputError, RecordKind, UsageError, content_id, describe
from sptool.rewards import WIST_INVALID_PENALTY, WIST_SIGMA
from sptool.core.stage import Stage
from sptool.stages.tree.document import record_observation
from sptool.stages.tree.posterior import (DEFAULT_TAU_VAR, REFERENCE_GROUP_THRESHOLD, group_learnability_observation,
                                    learnability_observation)


# --------------------------------------------------------------------------------------------
# Posterior update

RULES = ("variance", "reference")

VERDICT = RecordKind("verdict", (
    Field("path_id", (str,), help="the path this question came from (`tree expand`)"),
    Field("nodes", (list,), required=False, nullable=True, help="node ids of the path"),
    Field("var", (float,), required=False, nullable=True, help="p̂(1 − p̂) from `verify`"),
    Field("valid", (bool,), required=False, nullable=True),
))


class PosteriorUpdateStage(Stage):
    """Feed learnability observations g back into the tree (WIST §3.5).

    ``rule="variance"`` (paper, eq. 15): one g = 1(Var ≥ τ_var) per valid question, appended to the
    window of every node on its path. ``rule="reference"``: one g per group (document) =
    1(max challenger reward in the group > 0.4), the challenger reward being the record's
    ``challenger_reward`` or eq. 14 computed from ``var`` (ρ for invalid questions).

    Idempotent: each observation has a key (the verdict id, or ``group:<group_id>``) remembered in
    the tree's ``applied`` list, so a rerun of the same verdicts changes nothing. Records pass
    through with ``g`` added (null when not applied).
    """

    name = "posterior update"
    input_kind = VERDICT

    def __init__(self, tree: dict, *, rule: str = "variance", tau_var: float = DEFAULT_TAU_VAR,
                 group_threshold: float = REFERENCE_GROUP_THRESHOLD, sigma: float = WIST_SIGMA,
                 rho: float = WIST_INVALID_PENALTY, source: str = "<tree>"):
        super().__init__()
        if rule not in RULES:
            raise UsageError(f"unknown --rule '{rule}'; choose from {', '.join(RULES)}")
        if not 0 < tau_var <= 0.25:
            raise UsageError(f"--tau-var must be in (0, 0.25], got {tau_var}")
        self.tree = tree
        self.rule = rule
        self.tau_var = tau_var
        self.group_threshold = group_threshold
        self.sigma = sigma
        self.rho = rho
        self.source = source
        self.applied = set(tree["applied"])
        self.observations = 0
        # The node check is part of input validation, so a bad line is reported as source:line.
        nodes_field = Field("nodes", (list,), required=False, nullable=True, check=self._check_nodes,
                            help="node ids of the path")
        self.input_kind = RecordKind("verdict", tuple(nodes_field if f.name == "nodes" else f
                                                      for f in VERDICT.fields))

    def _check_nodes(self, nodes: list) -> str | None:
        for node_id in nodes:
            if not isinstance(node_id, str) or node_id not in self.tree["nodes"]:
                shown = json.dumps(node_id) if isinstance(node_id, str) else describe(node_id)
                return f"node {shown} is not in the tree {self.source} (verdicts from another tree?)"
        return None

    def _path_nodes(self, record: dict) -> list[str] | None:
        nodes = record.get("nodes")
        if nodes is None:
            nodes = self.tree["paths"].get(record["path_id"])
        if nodes is None:
            return None
        problem = self._check_nodes(nodes)
        if problem:
            raise InputError(problem, field="nodes")
        return list(nodes)

    def _apply(self, key: str, nodes: list[str], g: int) -> None:
        for node_id in nodes:
            record_observation(self.tree, node_id, g)
        self.applied.add(key)
        self.tree["applied"].append(key)
        self.observations += 1
        self.stats.notes[f"observations g={g}"] += 1

    def process(self, records: Iterator[dict]) -> Iterator[dict]:
        groups: dict[str, dict] = {}
        for record in records:
            record["g"] = None
            if record.get("valid") is False and self.rule == "variance":
                self.stats.notes["invalid questions (no observation)"] += 1
                yield record
                continue
            nodes = self._path_nodes(record)
            if nodes is None:
                self.stats.notes["unknown path_id (no nodes)"] += 1
                yield record
                continue
            if self.rule == "variance":
                if record.get("var") is None:
                    self.stats.notes["no var (verify error)"] += 1
                    yield record
                    continue
                key = str(record.get("id") or content_id(record.get("path_id"), record.get("question")))
                g = learnability_observation(float(record["var"]), self.tau_var)
                record["g"] = g
                if key in self.applied:
                    self.stats.notes["already applied"] += 1
                else:
                    self._apply(key, nodes, g)
                yield record
            else:
                reward = record.get("challenger_reward")
                if not isinstance(reward, (int, float)) or isinstance(reward, bool):
                    if record.get("valid") is False:
                        reward = self.rho
                    elif record.get("var") is None:
                        self.stats.notes["no var (verify error)"] += 1
                        yield record
                        continue
                    else:
                        from sptool.rewards import gaussian_variance_reward

                        reward = gaussian_variance_reward(float(record["var"]), self.sigma)
                key = "group:" + str(record.get("group_id") or record["path_id"])
                group = groups.setdefault(key, {"nodes": nodes, "max": -math.inf})
                group["max"] = max(group["max"], float(reward))
                yield record
        for key, group in groups.items():
            g = group_learnability_observation(group["max"], self.group_threshold)
            if key in self.applied:
                self.stats.notes["already applied"] += 1
            else:
                self._apply(key, group["nodes"], g)
