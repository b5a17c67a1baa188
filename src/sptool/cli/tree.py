"""``sptool tree init | expand | show``: the WIST domain tree (WIST §3.2)."""

from __future__ import annotations

import json
import os
from typing import List, Optional

import typer

from sptool.cli import common

tree_app = typer.Typer(
    help="The WIST domain tree: Thompson-sampled paths over Beta posteriors, grown where 'unk' "
         "is chosen.\n\nExample: sptool tree init --domain mathematics --tree tree.json && "
         "sptool tree expand --tree tree.json --paths 8 --titles package:titles.txt",
    no_args_is_help=True,
)

TreeOpt = typer.Option(..., "--tree", "-t", envvar="SPTOOL_TREE", help="The tree JSON file.")


def register(app: typer.Typer) -> None:
    app.add_typer(tree_app, name="tree")


@tree_app.command("init")
def init(
    domain: str = typer.Option(..., "--domain", "-d", help="Target domain label (child of the virtual root)."),
    tree_path: str = TreeOpt,
    max_depth: int = typer.Option(4, "--max-depth", "-L", help="Maximum depth L; leaves sit at depth L (WIST: 4)."),
    window: int = typer.Option(5, "--window", help="Sliding window size μ per node (WIST: 5)."),
    max_children: int = typer.Option(8, "--max-children",
                                     help="Cap on discovered children per node; at the cap 'unk' is masked."),
    child: Optional[List[str]] = typer.Option(None, "--child", "-c",
                                              help="A known child of the domain (repeatable)."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing tree file."),
    quiet: bool = common.QuietOpt,
) -> None:
    """Create a tree: virtual root → domain (→ known children), each internal node with an unk."""
    from sptool.core.records import UsageError
    from sptool.stages.tree import new_tree, save_tree

    if os.path.exists(tree_path) and not force:
        raise UsageError(f"{tree_path} exists; pass --force to overwrite it")
    tree = new_tree(domain, max_depth=max_depth, window_size=window, max_children=max_children,
                    children=child or [])
    save_tree(tree, tree_path)
    if not quiet:
        n = sum(1 for node in tree["nodes"].values() if not node["is_unk"]) - 1
        common.err_console.print(f"tree init: {tree_path}: domain '{tree['domain']}', {n} nodes, "
                                 f"max depth {max_depth}, window {window}", markup=False)


@tree_app.command("expand")
@common.backend_options()
@common.prompt_options("tree")
def expand(
    tree_path: str = TreeOpt,
    paths: int = typer.Option(128, "--paths", "-b", help="Paths to sample (B; WIST: 128)."),
    output: str = common.OutputOpt,
    seed: int = common.SeedOpt,
    titles: Optional[str] = typer.Option(None, "--titles", envvar="SPTOOL_TITLES",
                                         help="Offline title list (file, one a line) or folder; "
                                              "use where there is no network (e.g. package:titles.txt, shipped with sptool)."),
    wiki_url: Optional[str] = typer.Option(None, "--wiki-url", envvar="SPTOOL_WIKI_URL",
                                           help="MediaWiki api.php URL (default en.wikipedia.org)."),
    wiki_api: str = typer.Option("search", "--wiki-api", help="search (list=search) or opensearch."),
    allow_private: bool = typer.Option(False, "--allow-private",
                                       help="Let a --wiki-url redirect reach loopback and private "
                                            "addresses (never link-local/metadata)."),
    allow_network: List[str] = typer.Option([], "--allow-network",
                                            help="Allow exactly this CIDR block for --wiki-url and its "
                                                 "redirects, even link-local (repeatable)."),
    wiki_timeout: float = typer.Option(10.0, "--wiki-timeout", help="Total seconds per title search (connect, answer, body and retries)."),
    tau_wiki: float = typer.Option(0.8, "--tau-wiki", help="Accept a non-leaf node when s_max >= this."),
    duplicate_threshold: float = typer.Option(0.85, "--duplicate-threshold",
                                              help="Reject a proposal this similar to a sibling (rapidfuzz)."),
    max_attempts: int = typer.Option(3, "--max-attempts", help="Proposals per unk choice before giving up."),
    max_children: Optional[int] = typer.Option(None, "--max-children",
                                               help="Override the tree's per-node child cap."),
    proposals: int = typer.Option(1, "--proposals", help="Samples per proposal round (reference code: 5)."),
    min_votes: int = typer.Option(1, "--min-votes",
                                  help="Keep a label proposed at least this often (reference code: 2)."),
    path_rule: str = typer.Option("thompson", "--path-rule",
                                  help="thompson (WIST §3.2: draw from each child's posterior) or uniform "
                                       "(every child equally likely: the control that ignores the posteriors)."),
    reference_voting: bool = typer.Option(False, "--reference-voting",
                                          help="The reference code's rule: --proposals 5 --min-votes 2."),
    temperature: float = common.TemperatureOpt,
    max_tokens: int = typer.Option(32, "--max-tokens", help="Maximum new tokens per proposal."),
    rejects: Optional[str] = typer.Option(None, "--rejects",
                                          help="Also write rejected proposals (with 'reason') here as JSONL."),
    quiet: bool = common.QuietOpt,
    prompt_options: common.PromptOptions = None,
    backend_options: common.BackendOptions = None,
) -> None:
    """Thompson-sample B root-to-leaf paths (JSONL path records), growing the tree at 'unk'.

    Picking 'unk' asks the model for a new child complementary to the existing ones; near-duplicates
    are rejected, non-leaf proposals must match a title (s_max >= tau_wiki). The tree file is
    updated atomically; every rejected proposal is kept in its 'rejections' with the reason.
    """
    from sptool.core.jsonl import AtomicJsonlWriter
    from sptool.models.base import SamplingParams
    from sptool.stages.tree.title_sources import load_title_backend
    from sptool.stages.tree import ExpandOptions, TreeExpander, load_tree, save_tree

    common.check_outputs({"--output": output, "--rejects": rejects})
    if reference_voting:
        proposals, min_votes = max(proposals, 5), max(min_votes, 2)
    options = ExpandOptions(tau_wiki=tau_wiki, duplicate_threshold=duplicate_threshold,
                            max_attempts=max_attempts, proposals=proposals, min_votes=min_votes,
                            max_children=max_children, path_rule=path_rule)
    spec = prompt_options.load("tree")
    tree = load_tree(tree_path)
    title_backend = load_title_backend(titles, wiki_url, api=wiki_api, timeout_s=wiki_timeout,
                                       allow_private=allow_private, allow_networks=allow_network)
    params = SamplingParams(temperature=temperature, max_new_tokens=max_tokens, seed=seed)
    log = common.stderr_log(quiet)
    engine = backend_options.load(quiet)
    expander = TreeExpander(engine, title_backend, params=params, options=options, prompt=spec, log=log)
    with common.Progress("tree expand", quiet, unit="paths") as progress:
        try:
            records = expander.expand(tree, paths, seed)
        finally:
            engine.close()
        elapsed = progress.seconds
    # Outputs are written only after the whole batch succeeded: tree first (atomic), then paths.
    save_tree(tree, tree_path)
    with AtomicJsonlWriter(output) as out:
        for record in records:
            out.write(record)
    if rejects:
        with AtomicJsonlWriter(rejects, option="--rejects") as out:
            for rejection in expander.rejections:
                out.write(rejection)
    if not quiet:
        parts = [f"tree expand: {len(records)} paths"]
        parts += [f"{count} {name}" for name, count in sorted(expander.stats.items()) if name != "paths"]
        common.err_console.print(", ".join(parts) + f" in {elapsed:.1f}s [{tree_path}]",
                                 markup=False, soft_wrap=True)


@tree_app.command("show")
def show(
    tree_path: str = TreeOpt,
    fmt: str = typer.Option("text", "--format", "-f", help="text (terminal), json (rows) or png (picture)."),
    output: Optional[str] = typer.Option(None, "-o", "--output", help="Write here (required for png)."),
    hide_unk: bool = typer.Option(False, "--hide-unk", help="Leave out the unk placeholders."),
) -> None:
    """Show the tree with each node's posterior mean α̃/(α̃+β̃), window and visit count."""
    from sptool.core.records import UsageError
    from sptool.stages.tree import load_tree, tree_rows

    common.check_outputs({"--output": output})
    tree = load_tree(tree_path)
    rows = [row for row in tree_rows(tree) if not (hide_unk and row["is_unk"])]
    if fmt == "json":
        document = {"domain": tree["domain"], "revision": tree["revision"], "max_depth": tree["max_depth"],
                    "window_size": tree["window_size"], "nodes": rows,
                    "rejections": len(tree["rejections"])}
        text = json.dumps(document, ensure_ascii=False, indent=2) + "\n"
        if output:
            from sptool.core.jsonl import write_json_atomic
            write_json_atomic(output, document)
        else:
            typer.echo(text, nl=False)
    elif fmt == "png":
        if not output:
            raise UsageError("--format png needs -o FILE.png")
        from sptool.stages.tree.plot import plot_tree
        plot_tree(tree, rows, output)
        common.err_console.print(f"tree show: wrote {output} ({len(rows)} nodes)", markup=False)
    elif fmt == "text":
        _print_rich(tree, rows, output)
    else:
        raise UsageError(f"unknown --format '{fmt}'; choose from text, json, png")


def _print_rich(tree: dict, rows: list[dict], output: Optional[str]) -> None:
    from rich.console import Console
    from rich.text import Text
    from rich.tree import Tree

    def label(row: dict) -> Text:
        text = Text()
        if row["is_unk"]:
            text.append("unk", style="dim italic")
        else:
            text.append(row["label"], style="bold" if row["depth"] <= 1 else "")
        window = "".join(str(g) for g in row["window"]) or "-"
        colour = "green" if row["mean"] > 0.6 else "red" if row["mean"] < 0.4 else "yellow"
        text.append(f"  mean {row['mean']:.2f}", style=colour)
        text.append(f"  Beta({row['alpha']},{row['beta']})  window [{window}]  n={row['visits']}",
                    style="dim")
        return text

    by_id = {}
    root = Tree(Text(f"{tree['domain']} tree (revision {tree['revision']}, L={tree['max_depth']}, "
                     f"μ={tree['window_size']}, {len(tree['rejections'])} rejected proposals)",
                     style="bold"))
    for row in rows:
        if row["depth"] == 0:
            by_id[row["id"]] = root
            continue
        parent = by_id.get(row["parent"], root)
        by_id[row["id"]] = parent.add(label(row))
    if output:
        import io

        from sptool.core.jsonl import write_text_atomic

        buffer = io.StringIO()
        Console(file=buffer, width=120, no_color=True).print(root)
        write_text_atomic(output, buffer.getvalue())
    else:
        Console(highlight=False).print(root)
