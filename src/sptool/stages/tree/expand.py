"""``tree expand``: Thompson-sampled paths, growth through ``unk`` with validated proposals (WIST §3.2)."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from typing import Callable, Sequence

from sptool.core.records import UsageError, content_id
from sptool.stages.tree.document import (DEFAULT_DUPLICATE_THRESHOLD, DEFAULT_TAU_WIKI, PATH_RULES, add_node,
                                   node_path_labels, real_children, thompson_sample_path)
from sptool.stages.tree.titles import clean_proposal, near_duplicate, title_match


# --------------------------------------------------------------------------------------------
# Expansion

@dataclasses.dataclass
class ExpandOptions:
    """Knobs of `tree expand` (defaults: WIST Table of hyperparameters where the paper names one)."""

    tau_wiki: float = DEFAULT_TAU_WIKI
    duplicate_threshold: float = DEFAULT_DUPLICATE_THRESHOLD
    max_attempts: int = 3          # proposals (model calls) per unk choice before giving up
    proposals: int = 1             # samples per model call; the reference code uses 5 …
    min_votes: int = 1             # … and keeps a label proposed at least twice
    title_limit: int = 10          # titles requested per validation search
    max_restarts: int = 5          # path restarts after a failed expansion
    max_children: int | None = None  # override the tree's per-node cap
    path_rule: str = "thompson"    # or "uniform": the control that ignores the posteriors

    def __post_init__(self) -> None:
        if self.path_rule not in PATH_RULES:
            raise UsageError(f"--path-rule must be one of {', '.join(PATH_RULES)}, got {self.path_rule!r}")
        if not 0 <= self.tau_wiki <= 1:
            raise UsageError(f"--tau-wiki must be in [0, 1], got {self.tau_wiki}")
        if not 0 < self.duplicate_threshold <= 1:
            raise UsageError(f"--duplicate-threshold must be in (0, 1], got {self.duplicate_threshold}")
        if self.max_attempts < 1:
            raise UsageError(f"--max-attempts must be >= 1, got {self.max_attempts}")
        if self.proposals < 1 or not 1 <= self.min_votes <= self.proposals:
            raise UsageError(f"need 1 <= --min-votes <= --proposals, got {self.min_votes} and "
                             f"{self.proposals}")


def expansion_prompt(prompt, tree: dict, parent_id: str) -> list[dict[str, str]]:
    """Chat messages asking for one new child of ``parent_id`` given its path and siblings
    (``prompt``: a :class:`sptool.prompts.PromptSpec` of role ``tree``, or a template string)."""
    from sptool.prompts import PromptSpec, load_prompt

    if not isinstance(prompt, PromptSpec):
        prompt = dataclasses.replace(load_prompt("tree"), template=prompt)
    labels = node_path_labels(tree, parent_id)
    siblings = [tree["nodes"][c]["label"] for c in real_children(tree, parent_id)]
    depth = tree["nodes"][parent_id]["depth"] + 1
    level = "specific, searchable concept" if depth >= tree["max_depth"] else "subfield"
    return prompt.messages({}, domain=tree["domain"], path=" > ".join(labels),
                           parent=labels[-1] if labels else tree["domain"],
                           existing=", ".join(siblings) if siblings else "(none yet)", level=level)


def choose_by_votes(labels: Sequence[str | None], min_votes: int) -> tuple[str | None, int]:
    """The most frequent label (case-insensitive; first spelling kept) and its count, or None when
    no label reaches ``min_votes`` (the reference code: 5 proposals, keep one proposed ≥ twice)."""
    counts: Counter = Counter()
    spelling: dict[str, str] = {}
    for label in labels:
        if label:
            key = " ".join(label.lower().split())
            counts[key] += 1
            spelling.setdefault(key, label)
    if not counts:
        return None, 0
    key, count = max(counts.items(), key=lambda item: (item[1], -list(spelling).index(item[0])))
    return (spelling[key], count) if count >= min_votes else (None, count)


class TreeExpander:
    """Samples B paths by Thompson sampling, growing the tree where ``unk`` is chosen."""

    def __init__(self, backend, titles, *, params=None, options: ExpandOptions | None = None,
                 prompt: str | None = None, log: Callable[[str], None] | None = None):
        from sptool.models.base import SamplingParams
        from sptool.prompts import PromptSpec, load_prompt

        self.backend = backend
        self.titles = titles
        self.prompt = prompt if isinstance(prompt, PromptSpec) else load_prompt("tree", prompt)
        self.params = self.prompt.sampling(params or SamplingParams(temperature=1.0, max_new_tokens=32))
        self.options = options or ExpandOptions()
        self.log = log
        self.stats: Counter = Counter()
        self.rejections: list[dict] = []
        self._calls = 0

    def _propose(self, tree: dict, parent_id: str, seed: int) -> tuple[str | None, dict]:
        """One proposal round: ask the model (``proposals`` samples) and pick a label."""
        prompt = expansion_prompt(self.prompt, tree, parent_id)
        params = dataclasses.replace(self.params, seed=seed * 1_000_003 + self._calls)
        self._calls += 1
        samples = self.backend.generate([prompt], self.options.proposals, params)[0]
        raws = [sample.text for sample in samples]
        labels = [clean_proposal(text) for text in raws]
        label, votes = choose_by_votes(labels, self.options.min_votes)
        return label, {"raw": raws[0] if len(raws) == 1 else raws, "votes": votes}

    def _judge(self, tree: dict, parent_id: str, label: str) -> tuple[str | None, dict]:
        """Reject reason (None: accept) and the evidence for one proposed label."""
        nodes = tree["nodes"]
        siblings = [nodes[c]["label"] for c in real_children(tree, parent_id)]
        ancestors = node_path_labels(tree, parent_id)
        duplicate = near_duplicate(label, siblings, self.options.duplicate_threshold)
        if duplicate:
            return (f"near-duplicate: sibling '{duplicate[0]}' has similarity {duplicate[1]:.2f} >= "
                    f"{self.options.duplicate_threshold}"), {"duplicate_of": duplicate[0],
                                                             "similarity": round(duplicate[1], 4)}
        duplicate = near_duplicate(label, ancestors, self.options.duplicate_threshold)
        if duplicate:
            return (f"repeats-ancestor: '{duplicate[0]}' (similarity {duplicate[1]:.2f})",
                    {"duplicate_of": duplicate[0], "similarity": round(duplicate[1], 4)})
        depth = nodes[parent_id]["depth"] + 1
        if depth >= tree["max_depth"]:
            return None, {"validated": False, "why": "leaf depth: no title validation (WIST eq. 9 "
                                                     "applies to non-leaf nodes)"}
        titles = self.titles.search(label, self.options.title_limit)
        s_max, best = title_match(label, titles)
        evidence = {"validated": True, "title_backend": getattr(self.titles, "name", "titles"),
                    "s_max": round(s_max, 4), "best_title": best, "n_titles": len(titles)}
        if s_max < self.options.tau_wiki:
            shown = f"'{best}'" if best else "no title"
            return (f"title-validation: s_max {s_max:.2f} < tau_wiki "
                    f"{self.options.tau_wiki} (best {shown})"), evidence
        return None, evidence

    def grow(self, tree: dict, parent_id: str, seed: int) -> str | None:
        """Try up to ``max_attempts`` proposals for a new child of ``parent_id``; the new id or None."""
        for attempt in range(1, self.options.max_attempts + 1):
            label, info = self._propose(tree, parent_id, seed)
            self.stats["proposals"] += 1
            if label is None:
                reason = ("no-consensus: no label proposed at least "
                          f"{self.options.min_votes} times" if self.options.min_votes > 1
                          else "unparsable: no short topic label in the reply")
                evidence: dict = {}
            else:
                reason, evidence = self._judge(tree, parent_id, label)
            if reason is None:
                evidence.update({"source": "expand", "votes": info["votes"], "attempt": attempt,
                                 "model": getattr(self.backend, "model_id", None)})
                node_id = add_node(tree, parent_id, label, evidence=evidence)
                self.stats["nodes added"] += 1
                if self.log:
                    self.log(f"tree expand: + '{label}' under "
                             f"'{' > '.join(node_path_labels(tree, parent_id))}'")
                return node_id
            rejection = {"parent": parent_id, "parent_path": node_path_labels(tree, parent_id),
                         "proposal": label, "raw": info["raw"], "reason": reason,
                         "reason_code": reason.split(":", 1)[0],
                         "attempt": attempt, "revision": tree.get("revision", 0), **evidence}
            tree["rejections"].append(rejection)
            self.rejections.append(rejection)
            self.stats[f"rejected ({rejection['reason_code']})"] += 1
            if self.log:
                self.log(f"tree expand: rejected {json.dumps(label)} under "
                         f"'{' > '.join(rejection['parent_path'])}': {reason}")
        return None

    def expand(self, tree: dict, paths: int, seed: int = 0) -> list[dict]:
        """Sample ``paths`` root-to-leaf paths (growing the tree); return the path records."""
        import numpy as np

        if paths < 0:
            raise UsageError(f"--paths must be >= 0, got {paths}")
        if self.options.max_children is not None:
            tree["max_children"] = self.options.max_children
        rng = np.random.default_rng(seed)
        revision = tree.get("revision", 0)
        records = []
        failed_parents: set[str] = set()  # parents whose expansion failed: unk masked this run
        for index in range(paths):
            path = None
            for _restart in range(self.options.max_restarts + 1):
                candidate = thompson_sample_path(tree, rng, failed_parents, rule=self.options.path_rule)
                while candidate and tree["nodes"][candidate[-1]]["is_unk"]:
                    parent_id = tree["nodes"][candidate[-1]]["parent"]
                    new_id = self.grow(tree, parent_id, seed)
                    if new_id is None:
                        failed_parents.add(parent_id)
                        break
                    candidate[-1] = new_id
                    rest = thompson_sample_path(tree, rng, failed_parents, start=new_id,
                                                rule=self.options.path_rule)
                    candidate.extend(rest)
                if candidate and not tree["nodes"][candidate[-1]]["is_unk"] \
                        and tree["nodes"][candidate[-1]]["depth"] == tree["max_depth"]:
                    path = candidate
                    break
                self.stats["path restarts"] += 1
            if path is None:
                self.stats["paths abandoned (tree cannot grow)"] += 1
                continue
            labels = [tree["nodes"][n]["label"] for n in path]
            path_id = content_id("path", tree["domain"], revision, seed, index, path)
            tree["paths"][path_id] = path
            records.append({"id": path_id, "path_id": path_id, "nodes": path, "labels": labels,
                            "leaf": labels[-1], "leaf_id": path[-1], "domain": tree["domain"],
                            "tree_revision": revision + 1})
            self.stats["paths"] += 1
        return records
