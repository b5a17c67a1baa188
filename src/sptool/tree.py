"""The WIST domain tree: Beta posteriors with a sliding window, Thompson path sampling, unk expansion.

WIST §3.2 and §3.5 (WIST). The tree is one JSON document (not JSONL)::

    {"schema": "sptool.tree", "version": 1, "revision": 3, "domain": "mathematics",
     "max_depth": 4, "window_size": 5, "max_children": 8, "root": "root",
     "nodes": {"root": {...}, "<id>": {"id", "label", "depth", "parent", "children", "is_unk",
                                       "window", "alpha", "beta", "visits", "successes",
                                       "evidence"}},
     "paths": {"<path_id>": [node ids]}, "applied": [observation keys], "rejections": [...]}

- Depth 0 is the virtual root; its children are target domains (depth 1); leaves are at depth
  ``max_depth`` (L). Every node above depth L has an ``unk`` child that triggers growth.
- ``window`` holds the last μ learnability observations g ∈ {0, 1}; ``alpha``/``beta`` are the
  effective parameters of eq. 17 (recomputed from the window whenever it changes); ``visits`` and
  ``successes`` count every observation ever received.
- A path record lists the node ids from the domain node (depth 1) to the leaf (depth L); the
  virtual root is implied.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections import Counter
from typing import Any, Callable, Iterable, Iterator, Sequence

from sptool.jsonl import write_json_atomic
from sptool.records import (ANY, Field, InputError, RecordKind, UsageError, content_id, describe)
from sptool.rewards import WIST_INVALID_PENALTY, WIST_SIGMA
from sptool.stage import Stage

SCHEMA = "sptool.tree"
VERSION = 1
ROOT_ID = "root"
UNK_LABEL = "<unk>"
DEFAULT_MAX_DEPTH = 4          # WIST Table (hyperparameters): tree maximum depth L
DEFAULT_WINDOW = 5             # sliding window size μ
DEFAULT_TAU_VAR = 0.20         # learnability threshold τ_var
DEFAULT_TAU_WIKI = 0.8         # wiki validation threshold τ_wiki
DEFAULT_MAX_CHILDREN = 8       # per-node cap on discovered children (then unk is masked)
DEFAULT_DUPLICATE_THRESHOLD = 0.85
REFERENCE_GROUP_THRESHOLD = 0.4  # reference code: g = 1(max challenger reward in group > 0.4)
MAX_REJECTIONS_KEPT = 2000


# --------------------------------------------------------------------------------------------
# Formulas (pure functions)

def beta_posterior(window: Sequence[int]) -> tuple[int, int]:
    """Effective Beta parameters over the sliding window (WIST eq. 17), prior (1, 1).

    α̃ = 1 + Σ_{τ∈W} g^(τ),   β̃ = 1 + Σ_{τ∈W} (1 − g^(τ)).
    """
    successes = sum(int(g) for g in window)
    return 1 + successes, 1 + len(window) - successes


def posterior_mean(window: Sequence[int]) -> float:
    """Mean of Beta(α̃, β̃): α̃ / (α̃ + β̃)."""
    alpha, beta = beta_posterior(window)
    return alpha / (alpha + beta)


def learnability_observation(var: float, tau_var: float = DEFAULT_TAU_VAR) -> int:
    """Bernoulli learnability observation of one valid QA (WIST eq. 15): g = 1(Var ≥ τ_var)."""
    return int(var >= tau_var)


def slide_window(window: Sequence[int], g: int, size: int) -> list[int]:
    """Append ``g`` and keep only the most recent ``size`` observations (W_{i,j} in eq. 17)."""
    return ([*window, int(g)])[-size:] if size > 0 else []


def group_learnability_observation(max_challenger_reward: float,
                                   threshold: float = REFERENCE_GROUP_THRESHOLD) -> int:
    """Reference code's path-level rule: g = 1(max challenger reward in the group > 0.4)."""
    return int(max_challenger_reward > threshold)


def string_similarity(a: str, b: str) -> float:
    """sim_str of WIST eq. 9: normalised Indel similarity in [0, 1] of lower-cased, trimmed strings."""
    from rapidfuzz import fuzz, utils

    return fuzz.ratio(a, b, processor=utils.default_process) / 100.0


def title_match(label: str, titles: Iterable[str]) -> tuple[float, str | None]:
    """s_max = max_{w ∈ Ŵ} sim_str(label, w) (WIST eq. 9) and the best title."""
    best, best_title = 0.0, None
    for title in titles:
        score = string_similarity(label, title)
        if score > best:
            best, best_title = score, title
    return best, best_title


def near_duplicate(label: str, others: Iterable[str],
                   threshold: float = DEFAULT_DUPLICATE_THRESHOLD) -> tuple[str, float] | None:
    """The first of ``others`` whose similarity to ``label`` is ≥ ``threshold`` (token order ignored)."""
    from rapidfuzz import fuzz, utils

    for other in others:
        score = max(fuzz.ratio(label, other, processor=utils.default_process),
                    fuzz.token_sort_ratio(label, other, processor=utils.default_process)) / 100.0
        if score >= threshold:
            return other, score
    return None


_BULLET = re.compile(r"^\s*(?:[-*•#>]+|\d+[.)]|[a-z][.)])\s+", re.IGNORECASE)
_PREFIX = re.compile(r"^\s*(?:new\s+)?(?:sub-?topic|topic|label|answer|name|category)\s*(?:name)?\s*[:：-]\s*",
                     re.IGNORECASE)


def clean_proposal(text: str, max_words: int = 8) -> str | None:
    """The topic label in a model reply: first non-empty line, bullets/quotes/markup removed.

    Returns None when nothing usable remains or the label is longer than ``max_words`` words.
    """
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        line = _BULLET.sub("", line)
        line = _PREFIX.sub("", line)
        line = line.replace("**", "").replace("__", "").replace("`", "")
        if ":" in line:  # "Sure! Here is a new subtopic: Combinatorics" / "Here it is:" + next line
            tail = line.rsplit(":", 1)[1].strip()
            if not tail:
                continue
            line = tail
        quoted = re.search(r'["“]([^"”]+)["”]?', line)  # 'The new subtopic is "Prime numbers"'
        if quoted and quoted.group(1).strip():
            line = _BULLET.sub("", quoted.group(1).strip())
        line = line.strip().strip("\"'“”‘’«»").strip()
        line = re.split(r"(?<=[a-z0-9)])[.;:!?](?:\s|$)| - | — |\(", line, maxsplit=1)[0]
        line = line.strip().rstrip(".,;:!?").strip().strip("\"'“”‘’").strip()
        if not line or not re.search(r"[A-Za-z]", line):
            return None
        if len(line.split()) > max_words or len(line) > 80:
            return None
        return line
    return None


# --------------------------------------------------------------------------------------------
# The tree document

def _node(node_id: str, label: str, depth: int, parent: str | None, *, is_unk: bool = False,
          evidence: dict | None = None, revision: int = 0) -> dict:
    return {"id": node_id, "label": label, "depth": depth, "parent": parent, "children": [],
            "is_unk": is_unk, "window": [], "alpha": 1, "beta": 1, "visits": 0, "successes": 0,
            "evidence": evidence, "created_revision": revision}


def node_id_for(parent_id: str, label: str) -> str:
    """Deterministic node id: hash of the parent id and the normalised label."""
    return content_id("node", parent_id, label.strip().lower(), length=12)


def unk_id_for(parent_id: str) -> str:
    return content_id("unk", parent_id, length=12)


def new_tree(domain: str, *, max_depth: int = DEFAULT_MAX_DEPTH, window_size: int = DEFAULT_WINDOW,
             max_children: int = DEFAULT_MAX_CHILDREN, children: Iterable[str] = ()) -> dict:
    """A tree with the virtual root, the domain node (depth 1), optional known children, unks."""
    if not domain.strip():
        raise UsageError("--domain must be a non-empty label")
    if max_depth < 2:
        raise UsageError(f"--max-depth must be >= 2 (root, domain, leaves), got {max_depth}")
    if window_size < 1:
        raise UsageError(f"--window must be >= 1, got {window_size}")
    if max_children < 1:
        raise UsageError(f"--max-children must be >= 1, got {max_children}")
    tree = {"schema": SCHEMA, "version": VERSION, "revision": 0, "domain": domain.strip(),
            "max_depth": max_depth, "window_size": window_size, "max_children": max_children,
            "root": ROOT_ID, "nodes": {ROOT_ID: _node(ROOT_ID, "<root>", 0, None)},
            "paths": {}, "applied": [], "rejections": []}
    domain_id = add_node(tree, ROOT_ID, domain.strip(), evidence={"source": "init"})
    for label in children:
        if label.strip():
            add_node(tree, domain_id, label.strip(), evidence={"source": "init"})
    return tree


def add_node(tree: dict, parent_id: str, label: str, *, evidence: dict | None = None) -> str:
    """Add a discovered child of ``parent_id`` (and its own unk when it is not a leaf)."""
    nodes = tree["nodes"]
    parent = nodes[parent_id]
    depth = parent["depth"] + 1
    if depth > tree["max_depth"]:
        raise UsageError(f"cannot add '{label}' below a leaf (max depth {tree['max_depth']})")
    node_id = node_id_for(parent_id, label)
    if node_id in nodes:
        return node_id
    nodes[node_id] = _node(node_id, label, depth, parent_id, evidence=evidence,
                           revision=tree.get("revision", 0))
    unk = _unk_child(tree, parent_id)
    position = parent["children"].index(unk) if unk else len(parent["children"])
    parent["children"].insert(position, node_id)
    if depth < tree["max_depth"]:
        unk_id = unk_id_for(node_id)
        nodes[unk_id] = _node(unk_id, UNK_LABEL, depth + 1, node_id, is_unk=True,
                              revision=tree.get("revision", 0))
        nodes[node_id]["children"].append(unk_id)
    return node_id


def _unk_child(tree: dict, node_id: str) -> str | None:
    for child in tree["nodes"][node_id]["children"]:
        if tree["nodes"][child]["is_unk"]:
            return child
    return None


def real_children(tree: dict, node_id: str) -> list[str]:
    return [c for c in tree["nodes"][node_id]["children"] if not tree["nodes"][c]["is_unk"]]


def node_path_labels(tree: dict, node_id: str) -> list[str]:
    """Labels from the domain node down to ``node_id`` (virtual root excluded)."""
    labels = []
    nodes = tree["nodes"]
    while node_id is not None and node_id != tree["root"]:
        labels.append(nodes[node_id]["label"])
        node_id = nodes[node_id]["parent"]
    return labels[::-1]


def record_observation(tree: dict, node_id: str, g: int) -> None:
    """Append g to the node's window (keeping the last μ) and refresh α̃, β̃ (eq. 16–17)."""
    node = tree["nodes"][node_id]
    node["window"] = slide_window(node["window"], g, tree["window_size"])
    node["alpha"], node["beta"] = beta_posterior(node["window"])
    node["visits"] += 1
    node["successes"] += int(g)


def candidate_children(tree: dict, node_id: str, masked_unk: frozenset | set = frozenset()) -> list[str]:
    """Children Thompson sampling may pick: discovered ones, plus unk unless capped or masked."""
    children = []
    n_real = 0
    unk = None
    for child in tree["nodes"][node_id]["children"]:
        if tree["nodes"][child]["is_unk"]:
            unk = child
        else:
            children.append(child)
            n_real += 1
    if unk is not None and n_real < tree["max_children"] and node_id not in masked_unk:
        children.append(unk)
    return children


def thompson_sample_path(tree: dict, rng, masked_unk: frozenset | set = frozenset(), *,
                         start: str | None = None) -> list[str]:
    """Descend from ``start`` (default: the root): at each depth draw θ ~ Beta(α̃, β̃) for every
    candidate child and take the argmax (WIST §3.2). Stops at a leaf (depth L) or at a chosen
    ``unk`` (growth needed), or at a node with no candidates. Returns the node ids below ``start``.

    ``rng`` is a ``numpy.random.Generator``; ``masked_unk`` holds parent ids whose unk is masked.
    """
    nodes = tree["nodes"]
    current = tree["root"] if start is None else start
    path: list[str] = []
    while nodes[current]["depth"] < tree["max_depth"]:
        candidates = candidate_children(tree, current, masked_unk)
        if not candidates:
            break
        draws = [rng.beta(*beta_posterior(nodes[c]["window"])) for c in candidates]
        current = candidates[max(range(len(draws)), key=draws.__getitem__)]
        path.append(current)
        if nodes[current]["is_unk"]:
            break
    return path


# --------------------------------------------------------------------------------------------
# Loading and validating a tree file

_NODE_FIELDS = {"id": (str,), "label": (str,), "depth": (int,), "parent": (str, type(None)),
                "children": (list,), "is_unk": (bool,), "window": (list,), "visits": (int,)}


def validate_tree(document: Any, source: str = "<tree>") -> dict:
    """Check a tree document: schema and version, node fields, parent/child and depth consistency."""

    def fail(reason: str, field: str | None = None) -> InputError:
        return InputError(reason, source=source, field=field,
                          hint="the tree file is written by `sptool tree init/expand`; re-create it "
                               "or fix the field")

    if not isinstance(document, dict):
        raise fail(f"expected a JSON object (sptool tree), got {describe(document)}")
    if document.get("schema") != SCHEMA:
        raise fail(f"expected '{SCHEMA}', got {describe(document.get('schema'))}", "schema")
    if document.get("version") != VERSION:
        raise fail(f"expected version {VERSION}, got {describe(document.get('version'))}", "version")
    for key in ("max_depth", "window_size", "max_children", "revision"):
        value = document.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise fail(f"expected a non-negative integer, got {describe(value)}", key)
    nodes = document.get("nodes")
    if not isinstance(nodes, dict) or not nodes:
        raise fail(f"expected an object of nodes, got {describe(nodes)}", "nodes")
    root = document.get("root")
    if root not in nodes:
        raise fail(f"root {describe(root)} is not a node", "root")
    for key, default in (("paths", {}), ("applied", []), ("rejections", [])):
        document.setdefault(key, default)
        if not isinstance(document[key], type(default)):
            raise fail(f"expected {'an object' if isinstance(default, dict) else 'a list'}, "
                       f"got {describe(document[key])}", key)
    for node_id, node in nodes.items():
        where = f"nodes.{node_id}"
        if not isinstance(node, dict):
            raise fail(f"expected an object, got {describe(node)}", where)
        for name, types in _NODE_FIELDS.items():
            value = node.get(name)
            if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
                raise fail(f"expected {'/'.join(t.__name__ for t in types)}, got {describe(value)}",
                           f"{where}.{name}")
        if node["id"] != node_id:
            raise fail(f"id {describe(node['id'])} differs from its key", f"{where}.id")
        if any(g not in (0, 1) or isinstance(g, bool) for g in node["window"]):
            raise fail("expected observations 0 or 1", f"{where}.window")
        if len(node["window"]) > document["window_size"]:
            raise fail(f"holds {len(node['window'])} observations, more than window_size "
                       f"{document['window_size']}", f"{where}.window")
        parent = node["parent"]
        if node_id == root:
            if parent is not None or node["depth"] != 0:
                raise fail("the root must have parent null and depth 0", where)
        else:
            if parent not in nodes:
                raise fail(f"parent {describe(parent)} is not a node", f"{where}.parent")
            if node_id not in nodes[parent].get("children", []):
                raise fail(f"is not listed among the children of its parent '{parent}'", where)
            if node["depth"] != nodes[parent].get("depth", -2) + 1:
                raise fail(f"depth {node['depth']} is not its parent's depth + 1", f"{where}.depth")
        if node["depth"] > document["max_depth"]:
            raise fail(f"depth {node['depth']} exceeds max_depth {document['max_depth']}", f"{where}.depth")
        if node["is_unk"] and node["children"]:
            raise fail("an unk placeholder cannot have children", f"{where}.children")
        for child in node["children"]:
            if child not in nodes or nodes[child].get("parent") != node_id:
                raise fail(f"child {describe(child)} is missing or names another parent",
                           f"{where}.children")
        node["alpha"], node["beta"] = beta_posterior(node["window"])
        node.setdefault("successes", sum(node["window"]))
        node.setdefault("evidence", None)
    return document


def load_tree(path: str | os.PathLike) -> dict:
    """Read and validate a tree file; every problem is an :class:`InputError` naming the file."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise InputError("no such tree file", source=path, hint="create one with `sptool tree init`")
    if os.path.isdir(path):
        raise InputError("is a directory, expected a tree JSON file", source=path)
    from sptool.jsonl import load_json_file

    document = load_json_file(path, what="tree JSON")  # bounded: size, digits, nesting, text
    return validate_tree(document, source=path)


def save_tree(tree: dict, path: str | os.PathLike) -> None:
    """Write the tree atomically (temp file + rename), bumping its revision."""
    tree["revision"] = int(tree.get("revision", 0)) + 1
    if len(tree["rejections"]) > MAX_REJECTIONS_KEPT:
        tree["rejections"] = tree["rejections"][-MAX_REJECTIONS_KEPT:]
    write_json_atomic(path, tree)


def tree_rows(tree: dict) -> Iterator[dict]:
    """Depth-first rows for display: id, label, depth, is_unk, window, alpha, beta, mean, visits."""
    nodes = tree["nodes"]
    stack = [tree["root"]]
    while stack:
        node_id = stack.pop()
        node = nodes[node_id]
        alpha, beta = beta_posterior(node["window"])
        yield {"id": node_id, "label": node["label"], "depth": node["depth"], "parent": node["parent"],
               "is_unk": node["is_unk"], "window": list(node["window"]), "alpha": alpha,
               "beta": beta, "mean": alpha / (alpha + beta), "visits": node["visits"],
               "n_children": len(real_children(tree, node_id))}
        stack.extend(reversed(node["children"]))


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

    def __post_init__(self) -> None:
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
                candidate = thompson_sample_path(tree, rng, failed_parents)
                while candidate and tree["nodes"][candidate[-1]]["is_unk"]:
                    parent_id = tree["nodes"][candidate[-1]]["parent"]
                    new_id = self.grow(tree, parent_id, seed)
                    if new_id is None:
                        failed_parents.add(parent_id)
                        break
                    candidate[-1] = new_id
                    rest = thompson_sample_path(tree, rng, failed_parents, start=new_id)
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
