"""``sptool recipes list|show``: the packaged recipes and their effective configuration."""

from __future__ import annotations

import json
from typing import List, Optional

import typer

recipes_app = typer.Typer(help="Recipes (TOML) with the papers' defaults.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(recipes_app, name="recipes")


@recipes_app.command("list")
def list_recipes() -> None:
    """The recipe names, one a line, with the paper each follows."""
    from sptool.recipes import RECIPE_NAMES, recipe_summary

    for name in RECIPE_NAMES:
        typer.echo(f"{name}\t{recipe_summary(name)}")


@recipes_app.command("show")
def show(
    name: str = typer.Argument(..., help="wist, svs, rzero or rquest."),
    tiny: bool = typer.Option(False, "--tiny", help="Apply the recipe's tiny preset."),
    config_file: Optional[str] = typer.Option(None, "--config", envvar="SPTOOL_CONFIG",
                                              help="TOML file overriding the recipe."),
    sets: List[str] = typer.Option([], "--set", help="Override one key (KEY=VALUE, repeatable)."),
    fmt: str = typer.Option("toml", "--format", "-f", help="toml or json."),
    source: bool = typer.Option(False, "--source", help="Print the packaged recipe file (with its comments citing the paper)."),
    explain: bool = typer.Option(False, "--explain", help="toml: follow each key with its help text, "
                                 "the paper section it comes from and its default."),
) -> None:
    """Print the effective configuration (defaults < recipe < --tiny < --config < --set)."""
    from sptool.recipes import load_config, recipe_text, to_toml
    from sptool.core.records import UsageError

    if source:
        typer.echo(recipe_text(name), nl=False)
        return
    config = load_config(name, tiny=tiny, config_file=config_file, sets=sets)
    if fmt == "json":
        typer.echo(json.dumps(config, indent=2))
    elif fmt == "toml":
        typer.echo(to_toml(config, explain=explain), nl=False)
    else:
        raise UsageError(f"unknown --format '{fmt}'; choose from toml, json")
