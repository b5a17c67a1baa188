"""The WIST domain tree (a package: :mod:`.document`, :mod:`.posterior`, :mod:`.titles`,
:mod:`.expand`, :mod:`.update`, :mod:`.plot`): Beta posteriors with a sliding window, Thompson path sampling, unk expansion.

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

from sptool.stages.tree.document import (  # noqa: F401
    DEFAULT_DUPLICATE_THRESHOLD, DEFAULT_MAX_CHILDREN, DEFAULT_MAX_DEPTH,
    DEFAULT_TAU_WIKI, DEFAULT_WINDOW, MAX_REJECTIONS_KEPT, PATH_RULES, ROOT_ID,
    SCHEMA, UNK_LABEL, VERSION, _NODE_FIELDS, _node, _unk_child, add_node, candidate_children,
    load_tree, new_tree, node_id_for, node_path_labels, real_children, record_observation,
    save_tree, thompson_sample_path, tree_rows, unk_id_for, validate_tree)
from sptool.stages.tree.posterior import (  # noqa: F401
    DEFAULT_TAU_VAR, REFERENCE_GROUP_THRESHOLD, beta_posterior, group_learnability_observation, learnability_observation, posterior_mean,
    slide_window)
from sptool.stages.tree.titles import (  # noqa: F401
    _BULLET, _PREFIX, clean_proposal, near_duplicate, string_similarity, title_match)
from sptool.stages.tree.expand import (  # noqa: F401
    ExpandOptions, TreeExpander, choose_by_votes, expansion_prompt)
from sptool.stages.tree.update import (  # noqa: F401
    PosteriorUpdateStage, RULES, VERDICT)
