"""``sptool filter --recipe wist|rzero|rquest|svs``: verified records → training groups."""

from __future__ import annotations

from typing import Optional

import typer

from sptool.cli import common


def register(app: typer.Typer) -> None:
    app.command("filter")(filter_command)


def filter_command(
    input_path: Optional[str] = common.InputArg,
    recipe: str = typer.Option(..., "--recipe", "-r", envvar="SPTOOL_RECIPE",
                               help="wist, rzero, rquest or svs."),
    output: str = common.OutputOpt,
    advantage: str = typer.Option("dr_grpo", "--advantage",
                                  help="dr_grpo (A = r - mean r) or grpo ((r - mean) / (std + eps))."),
    batch_size: int = typer.Option(512, "--batch-size",
                                   help="rzero/rquest: records per batch for the BLEU repetition "
                                        "penalty (a group_id is never split)."),
    seed: int = common.SeedOpt,
    sigma: float = typer.Option(0.02, "--sigma", help="wist: width of the Gaussian variance reward."),
    invalid_penalty: float = typer.Option(-0.1, "--invalid-penalty",
                                          help="wist: challenger reward rho of an invalid QA."),
    uncertainty: str = typer.Option("paper", "--uncertainty",
                                    help="rzero: paper (1 - 2|p - 0.5|) or reference (min(p, 1 - p))."),
    bleu_threshold: float = typer.Option(0.5, "--bleu-threshold",
                                         help="rzero: clustering distance threshold on 1 - BLEU."),
    bleu_pairing: str = typer.Option("mean", "--bleu-pairing",
                                     help="rzero: mean (symmetric BLEU) or reference (R-Zero code: "
                                          "hypothesis = earlier question)."),
    clip_questioner_reward: bool = typer.Option(False, "--clip-questioner-reward",
                                                help="rzero: max(0, uncertainty - penalty) as in the "
                                                     "R-Zero paper."),
    solver_band: str = typer.Option("0.3,0.8", "--solver-band",
                                    help="rzero/rquest: keep solver data with LOW <= p <= HIGH."),
    format_weight: Optional[float] = typer.Option(
        None, "--format-weight",
        help="Solver reward (1-w)*correct + w*format (a boxed answer). Default 0.1 for rzero/rquest, "
             "0 for svs (the paper's binary reward; w > 0 keeps groups whose rewards differ)."),
    replay: Optional[str] = typer.Option(None, "--replay",
                                         help="rquest: solved+verified validity set to replay as "
                                              "validity groups."),
    replay_share: float = typer.Option(0.1, "--replay-share",
                                       help="rquest: share of solver-side groups that are replay."),
    validity_init: bool = typer.Option(False, "--validity-init",
                                       help="rquest: the input is a labelled validity set (solve "
                                            "--mode validity | verify); emit validity groups."),
    synthesis_band: str = typer.Option("0.125,0.625", "--synthesis-band",
                                       help="svs: variant accuracy band with synthesis reward 1."),
    negative_synthesis: bool = typer.Option(False, "--negative-synthesis-reward",
                                            help="svs: reward -1 (not 0) outside the band."),
    quiet: bool = common.QuietOpt,
    skip_invalid: bool = common.SkipInvalidOpt,
    rejects: Optional[str] = common.RejectsOpt,
) -> None:
    """Turn verified records into training groups (role, prompt, completions, rewards, advantages)."""
    from sptool.filter import FilterOptions, FilterStage, parse_band

    options = FilterOptions(
        advantage=advantage.replace("-", "_"), batch_size=batch_size, seed=seed, sigma=sigma,
        invalid_penalty=invalid_penalty, uncertainty=uncertainty, bleu_threshold=bleu_threshold,
        bleu_pairing=bleu_pairing, clip_questioner_reward=clip_questioner_reward,
        solver_band=parse_band(solver_band, "--solver-band"), format_weight=format_weight,
        replay=replay, replay_share=replay_share, validity_init=validity_init,
        synthesis_band=parse_band(synthesis_band, "--synthesis-band"),
        negative_synthesis=negative_synthesis)
    stage = FilterStage(recipe, options)
    common.run_stage(stage, input_path=input_path, output=output, quiet=quiet,
                     skip_invalid=skip_invalid, rejects=rejects)
