"""``sptool filter --recipe wist|rzero|rquest|svs|rlvr``: verified records → training groups.

The recipe-specific options are the fields of each recipe's options dataclass (``sptool.filter``);
their help text and defaults come from there, and an option of another recipe is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import typer

from sptool.cli import common
from sptool.filter.pseudo_label import PseudoLabelOptions, RQuestOptions, RZeroOptions
from sptool.filter.rlvr import RlvrOptions
from sptool.filter.svs import SvsOptions
from sptool.filter.wist import WistOptions
from sptool.settings import help_text


def register(app: typer.Typer) -> None:
    app.command("filter")(filter_command)


def _help(who: str, options: type, name: str) -> str:
    return f"{who}: {help_text(options, name)}."


@common.stage_io()
def filter_command(
    input_path: Optional[str] = common.InputArg,
    recipe: str = typer.Option(..., "--recipe", "-r", envvar="SPTOOL_RECIPE",
                               help="wist, rzero, rquest, svs or rlvr."),
    output: str = common.OutputOpt,
    advantage: str = typer.Option("dr_grpo", "--advantage",
                                  help="dr_grpo (A = r - mean r) or grpo ((r - mean) / (std + eps))."),
    batch_size: Optional[int] = typer.Option(
        None, "--batch-size", help=_help("rzero/rquest", PseudoLabelOptions, "batch_size")),
    seed: int = common.SeedOpt,
    sigma: Optional[float] = typer.Option(None, "--sigma", help=_help("wist", WistOptions, "sigma")),
    invalid_penalty: Optional[float] = typer.Option(
        None, "--invalid-penalty", help=_help("wist", WistOptions, "invalid_penalty")),
    uncertainty: Optional[str] = typer.Option(
        None, "--uncertainty", help=_help("rzero", RZeroOptions, "uncertainty")),
    bleu_threshold: Optional[float] = typer.Option(
        None, "--bleu-threshold", help=_help("rzero", RZeroOptions, "bleu_threshold")),
    bleu_pairing: Optional[str] = typer.Option(
        None, "--bleu-pairing", help=_help("rzero", RZeroOptions, "bleu_pairing")),
    clip_questioner_reward: bool = typer.Option(
        False, "--clip-questioner-reward", help=_help("rzero", RZeroOptions, "clip_questioner_reward")),
    solver_band: Optional[str] = typer.Option(
        None, "--solver-band", help=_help("rzero/rquest", PseudoLabelOptions, "solver_band")),
    format_weight: Optional[float] = typer.Option(
        None, "--format-weight",
        help="rzero/rquest/svs/rlvr: " + help_text(PseudoLabelOptions, "format_weight", default=False) +
             f"; default {PseudoLabelOptions.format_weight} for rzero/rquest, {SvsOptions.format_weight} "
             "for svs and rlvr (binary correctness; w > 0 keeps groups whose rewards differ)."),
    replay: Optional[str] = typer.Option(None, "--replay",
                                         help="rquest: solved+verified validity set to replay as "
                                              "validity groups."),
    replay_share: Optional[float] = typer.Option(
        None, "--replay-share", help=_help("rquest", RQuestOptions, "replay_share")),
    validity_init: bool = typer.Option(False, "--validity-init",
                                       help="rquest: the input is a labelled validity set (solve "
                                            "--mode validity | verify); emit validity groups."),
    synthesis_band: Optional[str] = typer.Option(
        None, "--synthesis-band", help=_help("svs", SvsOptions, "synthesis_band")),
    negative_synthesis: bool = typer.Option(
        False, "--negative-synthesis-reward", help=_help("svs", SvsOptions, "negative_synthesis")),
    keep_equal_groups: bool = typer.Option(
        False, "--keep-equal-groups", help=_help("rlvr", RlvrOptions, "keep_equal_groups")),
    stage_io: common.StageIO = None,
) -> None:
    """Turn verified records into training groups (role, prompt, completions, rewards, advantages)."""
    from sptool.filter import FILTERS
    from sptool.core.jsonl import read_records
    from sptool.core.records import UsageError
    from sptool.settings import parse_band

    FILTERS.check(recipe)
    if (replay or validity_init) and recipe != "rquest":
        raise UsageError("--replay and --validity-init belong to --recipe rquest")
    if validity_init and replay:
        raise UsageError("--validity-init already emits validity groups; drop --replay")
    given = {"batch_size": batch_size, "sigma": sigma, "invalid_penalty": invalid_penalty,
             "uncertainty": uncertainty, "bleu_threshold": bleu_threshold, "bleu_pairing": bleu_pairing,
             "clip_questioner_reward": clip_questioner_reward or None,
             "solver_band": parse_band(solver_band, "--solver-band") if solver_band else None,
             "format_weight": format_weight, "replay_share": replay_share,
             "synthesis_band": parse_band(synthesis_band, "--synthesis-band") if synthesis_band else None,
             "negative_synthesis": negative_synthesis or None, "keep_equal_groups": keep_equal_groups or None}
    given = {name: value for name, value in given.items() if value is not None}
    common_options = dict(advantage=advantage.replace("-", "_"), seed=seed)
    if validity_init:
        from sptool.filter.pseudo_label import ValidityInitFilter

        refuse_foreign(given, recipe, set(), "--validity-init")
        stage = ValidityInitFilter(**common_options)
    else:
        filter_class = FILTERS.get(recipe)
        refuse_foreign(given, recipe, {f.name for f in dataclasses.fields(filter_class.Options)})
        options = filter_class.Options(**given)
        if replay:
            stage = filter_class(options, replay=read_records(replay), replay_source=replay, **common_options)
        else:
            stage = filter_class(options, **common_options)
    stage_io.run(stage, input_path=input_path, output=output)


def refuse_foreign(given: dict, recipe: str, own: set[str], mode: str = "") -> None:
    """One usage error for the first option that is not one of ``recipe``'s."""
    from sptool.filter import FILTERS
    from sptool.core.records import UsageError

    for name in given:
        if name in own:
            continue
        owners = [r for r in FILTERS.names()
                  if name in {f.name for f in dataclasses.fields(FILTERS.get(r).Options)}]
        flag = ("--negative-synthesis-reward" if name == "negative_synthesis"
                else "--" + name.replace("_", "-"))
        if mode:
            raise UsageError(f"{flag} is not an option of {mode}")
        raise UsageError(f"{flag} is not an option of --recipe {recipe} "
                         f"(it belongs to --recipe {', '.join(owners)})")
