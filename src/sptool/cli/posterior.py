"""``sptool posterior update``: learnability feedback into the tree's node posteriors (WIST §3.5)."""

from __future__ import annotations

from typing import Optional

import typer

from sptool.cli import common
from sptool.rewards import WIST_SIGMA
from sptool.stages.tree import DEFAULT_TAU_VAR, REFERENCE_GROUP_THRESHOLD

posterior_app = typer.Typer(
    help="Update the domain tree's Beta posteriors from verdicts.\n\n"
         "Example: sptool verify solved.jsonl | sptool posterior update --tree tree.json -q > /dev/null",
    no_args_is_help=True,
)


def register(app: typer.Typer) -> None:
    app.add_typer(posterior_app, name="posterior")


@posterior_app.command("update")
@common.stage_io()
def update(
    input_path: Optional[str] = common.InputArg,
    tree_path: str = typer.Option(..., "--tree", "-t", envvar="SPTOOL_TREE", help="The tree JSON file."),
    output: str = common.OutputOpt,
    rule: str = typer.Option("variance", "--rule",
                             help="variance: g = 1(Var >= tau_var) per valid question (paper, eq. 15); "
                                  "reference: g = 1(max challenger reward in the group > 0.4) per group."),
    tau_var: float = typer.Option(DEFAULT_TAU_VAR, "--tau-var", help="Learnability threshold τ_var (WIST: 0.20)."),
    group_threshold: float = typer.Option(REFERENCE_GROUP_THRESHOLD, "--group-threshold",
                                          help="Reference rule: threshold on the group's max challenger reward."),
    sigma: float = typer.Option(WIST_SIGMA, "--sigma", help="Reference rule: challenger reward width σ (eq. 14)."),
    stage_io: common.StageIO = None,
) -> None:
    """Append g to the window of every node on each verdict's path; records pass through with 'g'.

    Verdicts need 'path_id' (and 'nodes', else the path is looked up in the tree), 'var' and
    'valid'. Idempotent: verdicts already applied (by id) are not counted twice.
    """
    from sptool.stages.tree import PosteriorUpdateStage, load_tree, save_tree

    tree = load_tree(tree_path)
    stage = PosteriorUpdateStage(tree, rule=rule, tau_var=tau_var, group_threshold=group_threshold,
                                 sigma=sigma, source=tree_path)

    def save() -> None:  # the tree first: a failure leaves neither a new tree nor a new --output
        if stage.observations:
            save_tree(tree, tree_path)

    stage_io.run(stage, input_path=input_path, output=output, before_commit=save)
