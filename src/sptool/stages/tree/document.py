"""The tree document: constants, nodes, Thompson path sampling, validation and files."""

from __future__ import annotations

import os
from typing import Any, Iterable, Iterator

from sptool.core.jsonl import write_json_atomic
from sptool.core.records import InputError, UsageError, content_id, describe
from sptool.stages.tree.posterior import beta_posterior, slide_window

SCHEMA = "sptool.tree"
VERSION = 1
ROOT_ID = "root"
UNK_LABEL = "<unk>"
DEFAULT_MAX_DEPTH = 4          # WIST Table (hyperparameters): tree maximum depth L
DEFAULT_WINDOW = 5             # sliding window size μ
DEFAULT_TAU_WIKI = 0.8         # wiki validation threshold τ_wiki
DEFAULT_MAX_CHILDREN = 8       # per-node cap on discovered children (then unk is masked)
DEFAULT_DUPLICATE_THRESHOLD = 0.85
MAX_REJECTIONS_KEPT = 2000


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


PATH_RULES = ("thompson", "uniform")


def thompson_sample_path(tree: dict, rng, masked_unk: frozenset | set = frozenset(), *,
                         start: str | None = None, rule: str = "thompson") -> list[str]:
    """Descend from ``start`` (default: the root): at each depth draw θ ~ Beta(α̃, β̃) for every
    candidate child and take the argmax (WIST §3.2). Stops at a leaf (depth L) or at a chosen
    ``unk`` (growth needed), or at a node with no candidates. Returns the node ids below ``start``.

    ``rule="uniform"`` is the control that ignores the posteriors: θ ~ Beta(1, 1) for every
    child, so each candidate is equally likely at every depth.

    ``rng`` is a ``numpy.random.Generator``; ``masked_unk`` holds parent ids whose unk is masked.
    """
    if rule not in PATH_RULES:
        raise ValueError(f"path rule must be one of {', '.join(PATH_RULES)}, got {rule!r}")
    nodes = tree["nodes"]
    current = tree["root"] if start is None else start
    path: list[str] = []
    while nodes[current]["depth"] < tree["max_depth"]:
        candidates = candidate_children(tree, current, masked_unk)
        if not candidates:
            break
        draws = [rng.beta(*(beta_posterior(nodes[c]["window"]) if rule == "thompson" else (1, 1)))
                 for c in candidates]
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
    for index, key in enumerate(document["applied"]):  # observation keys, compared in a set
        if not isinstance(key, str):
            raise fail(f"expected a list of strings (observation keys), item {index} is {describe(key)}",
                       "applied")
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
    """Read and validate a tree file (``package:NAME``: one shipped with sptool); every problem is an
    :class:`InputError` naming the file."""
    from sptool.core.packaged import local_path

    path = local_path(os.fspath(path))
    if not os.path.exists(path):
        raise InputError("no such tree file", source=path, hint="create one with `sptool tree init`")
    if os.path.isdir(path):
        raise InputError("is a directory, expected a tree JSON file", source=path)
    from sptool.core.jsonl import load_json_file

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
