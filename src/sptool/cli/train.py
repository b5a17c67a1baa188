"""``sptool train-step``: one policy-gradient update (Dr. GRPO, GRPO, DAPO) from training groups."""

from __future__ import annotations

import contextlib
import json
import time
from typing import Optional

import typer

from sptool.cli import common


def register(app: typer.Typer) -> None:
    app.command("train-step")(train_step)


def _split_list(value: Optional[str]) -> Optional[list[str]]:
    if value is None:
        return None
    items = [item.strip() for item in value.split(",") if item.strip()]
    return items or None


def format_metrics(metrics: dict) -> str:
    """The one-line metrics summary printed on stderr after each update."""
    rewards = " ".join(f"reward[{role}]={value:.3f}" for role, value in metrics["reward_mean"].items())
    parts = [f"train-step {metrics['step']}:", f"loss={metrics['loss']:.5g}", rewards,
             f"adv={metrics['advantage']['mean']:.3f}±{metrics['advantage']['std']:.3f}",
             f"clip={metrics['clip_fraction']:.3f}"]
    if metrics.get("kl") is not None:
        parts.append(f"kl={metrics['kl']:.4g}")
    if metrics.get("entropy") is not None:
        parts.append(f"entropy={metrics['entropy']:.3f}")
    parts += [f"grad_norm={metrics['grad_norm']:.3g}", f"tokens={metrics['tokens']}",
              f"tok/s={metrics['tokens_per_s']:.0f}", f"peak_mem={metrics['peak_memory_mb']:.0f}MB"]
    if metrics.get("skipped"):
        parts.append("(no update: all advantages zero)")
    return " ".join(part for part in parts if part)


def train_step(
    input_path: Optional[str] = common.InputArg,
    model: str = common.ModelOpt,
    output: str = typer.Option(..., "-o", "--output", help="Checkpoint directory to write (atomically). "
                               "May be an existing checkpoint (replaced), even --model itself."),
    loss: str = typer.Option("dr_grpo", "--loss", help="dr_grpo (A = r − mean r, global normaliser), "
                             "grpo (A normalised by std, per-sequence mean), dapo (token-level mean, clip-higher)."),
    beta: float = typer.Option(0.0, "--beta", help="KL coefficient to the frozen reference (k3 estimator); "
                               "0 for WIST/SvS, 1e-2 for R-Zero/R-Quest."),
    learning_rate: float = typer.Option(1e-6, "--learning-rate", "--lr", help="AdamW learning rate."),
    weight_decay: float = typer.Option(0.0, "--weight-decay", help="AdamW weight decay."),
    max_grad_norm: float = typer.Option(1.0, "--max-grad-norm", help="Clip the gradient norm (0: off)."),
    clip_low: Optional[float] = typer.Option(None, "--clip-low", help="ε_low (default 0.2)."),
    clip_high: Optional[float] = typer.Option(None, "--clip-high", help="ε_high (default 0.2; dapo 0.28)."),
    max_completion_tokens: Optional[int] = typer.Option(
        None, "--max-completion-tokens", "--normaliser-length", help="The generation budget (max new tokens "
        "per completion): Dr. GRPO's constant L in N·L (Liu et al. 2025). Without it, the longest completion "
        "of the batch stands in. grpo and dapo keep their own normalisers."),
    recompute_advantages: bool = typer.Option(False, "--recompute-advantages", help="Ignore the groups' "
                                              "'advantages' and compute them from 'rewards' for --loss."),
    temperature: float = typer.Option(1.0, "--temperature", help="Divide logits by this (as sampling did)."),
    max_tokens_per_micro_batch: int = typer.Option(
        4096, "--max-tokens-per-micro-batch", help="Padded tokens per forward/backward (gradient accumulation)."),
    roles: Optional[str] = typer.Option(None, "--roles", help="Comma-separated roles to train on "
                                        "(e.g. solver or questioner); other groups are skipped."),
    groups_per_update: int = typer.Option(0, "--groups-per-update", help="Split the input into consecutive "
                                          "chunks of N groups, one optimizer update each (0: all groups, one update)."),
    lora_r: int = typer.Option(0, "--lora-r", help="Train a LoRA adapter of this rank (0: full fine-tuning)."),
    lora_alpha: Optional[float] = typer.Option(None, "--lora-alpha", help="LoRA alpha (default 2·r)."),
    lora_dropout: float = typer.Option(0.0, "--lora-dropout", help="LoRA dropout."),
    lora_target_modules: str = typer.Option("all-linear", "--lora-target-modules",
                                            help="Comma-separated module names, or all-linear."),
    ref_model: Optional[str] = typer.Option(None, "--ref-model", help="Frozen KL reference (default: the one "
                                            "recorded in the checkpoint, else --model). LoRA uses its base."),
    no_chat_template: bool = common.NoChatTemplateOpt,
    device: Optional[str] = typer.Option(None, "--device", envvar="SPTOOL_DEVICE", help="cpu or cuda "
                                         "(default: cuda when available; under accelerate launch, its choice)."),
    mixed_precision: Optional[str] = typer.Option(None, "--mixed-precision", help="no (float32), bf16, fp16 "
                                                  "(default: bf16 on CUDA, with stochastic weight rounding and the "
                                                  "trainer's own log π_old; no on CPU)."),
    old_logprobs: str = typer.Option("auto", "--old-logprobs", help="Where log π_old comes from: sampler "
                                     "(the groups' 'old_logprobs') or trainer (its own forward in its own precision: "
                                     "the first update has ratio 1; the sampler's log-probs feed the gap metric and "
                                     "--tis-cap); auto: trainer under bf16/fp16 or with --tis-cap, else sampler."),
    tis_cap: float = typer.Option(0.0, "--tis-cap", help="Truncated importance sampling: each token's policy-"
                                  "gradient term times min(exp(log π_trainer − log π_sampler), CAP); 0: off; needs "
                                  "--old-logprobs trainer."),
    fp32_head: bool = typer.Option(False, "--fp32-head", help="Under bf16 or fp16 autocast, the LM head's matmul and "
                                   "log-softmax in float32 (the body stays in the autocast precision)."),
    tf32: bool = typer.Option(False, "--tf32", help="On CUDA, float32 matmuls on TF32 tensor cores (float32 "
                              "weights and accumulation; products with a 10-bit mantissa)."),
    weight_rounding: str = typer.Option("auto", "--weight-rounding", help="How a bf16/fp16 forward rounds "
                                        "the float32 master weights: nearest (autocast's cast; an update below half "
                                        "a rounding step is invisible), split (hi + lo: one more matmul per linear, "
                                        "every update seen), stochastic (bf16: unbiased, no extra matmul); auto: "
                                        "stochastic under bf16, else nearest."),
    full_logits: bool = typer.Option(False, "--full-logits", help="Compute [tokens × vocabulary] logits "
                                     "(the previous, slower and larger path) instead of log-probs in token chunks."),
    no_entropy: bool = typer.Option(False, "--no-entropy", help="Skip the entropy metric (one pass less over "
                                    "each logit chunk)."),
    compile_model: Optional[bool] = typer.Option(None, "--compile/--no-compile", help="torch.compile each "
                                                 "decoder layer and the log-prob kernels (default: on CUDA; the first "
                                                 "update pays ≈ 10-20 s of compiling, cached on disk)."),
    metrics_path: Optional[str] = typer.Option(None, "--metrics", help="Append one JSON line of metrics per update."),
    seed: int = common.SeedOpt,
    quiet: bool = common.QuietOpt,
    skip_invalid: bool = common.SkipInvalidOpt,
    rejects: Optional[str] = common.RejectsOpt,
) -> None:
    """One optimizer update (Dr. GRPO / GRPO / DAPO) from training groups; writes a checkpoint.

    Records need 'prompt', 'completions', 'rewards' (optional 'role', 'advantages',
    'old_logprobs', 'finish_reasons'). Run the same command under `accelerate launch` or
    `torchrun` to split the batch across processes.
    """
    from sptool.core.jsonl import AtomicJsonlWriter, read_records, source_name
    from sptool.core.records import UsageError
    from sptool.train import checkpoint as ckpt
    from sptool.train.step import TRAINING_GROUP, PolicyTrainer, TrainConfig, select_roles, split_updates

    if groups_per_update < 0:
        raise UsageError(f"--groups-per-update must be >= 0, got {groups_per_update}")
    ckpt.check_output_path(output)
    common.check_outputs({"--rejects": rejects, "--metrics": metrics_path}, inputs=[input_path])
    config = TrainConfig(
        model=model, loss=loss, beta=beta, learning_rate=learning_rate, weight_decay=weight_decay,
        max_grad_norm=max_grad_norm, clip_low=clip_low, clip_high=clip_high,
        max_completion_tokens=max_completion_tokens,
        recompute_advantages=recompute_advantages,
        temperature=temperature, max_tokens_per_micro_batch=max_tokens_per_micro_batch, roles=_split_list(roles),
        lora_r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
        lora_target_modules=_split_list(lora_target_modules) or ["all-linear"], ref_model=ref_model,
        chat_template=not no_chat_template, device=device, mixed_precision=mixed_precision, seed=seed,
        full_logits=full_logits, entropy=not no_entropy, compile=compile_model,
        old_logprobs=old_logprobs, tis_cap=tis_cap, fp32_head=fp32_head, tf32=tf32,
        weight_rounding=weight_rounding,
        compile_kernels=compile_model)
    common.waiting_for_stdin_hint(input_path, quiet)
    started = time.monotonic()
    counts = {"read": 0, "invalid": 0, "skipped_role": 0}
    rejects_writer = AtomicJsonlWriter(rejects, option="--rejects") if rejects else contextlib.nullcontext(None)
    with rejects_writer as rejected:

        def on_invalid(error, raw: str) -> None:
            counts["invalid"] += 1
            if rejected is not None:
                rejected.write({"reject_reason": error.message, "line": raw.rstrip("\n")})

        def on_skip(group: dict) -> None:
            counts["skipped_role"] += 1

        records = []
        for record in read_records(input_path, TRAINING_GROUP, skip_invalid=skip_invalid, on_invalid=on_invalid):
            counts["read"] += 1
            records.append(record)
        groups = select_roles(records, config.roles, on_skip)

    # Only now load the model (bad input fails fast, before any heavy import).
    log = None if quiet else (lambda message: common.err_console.print(message, markup=False))
    trainer = PolicyTrainer(config, log=log)
    main = trainer.is_main_process
    say = (lambda message: None) if quiet or not main else log
    if not groups:
        say(f"train-step: no training groups{' for roles ' + roles if roles else ''}: "
            f"no update, the checkpoint is written unchanged")
    updates = split_updates(groups, groups_per_update) if groups else []
    metrics_file = open(metrics_path, "a", encoding="utf-8") if metrics_path and main else None
    try:
        for chunk in updates:
            metrics = trainer.update(chunk)
            say(format_metrics(metrics))
            if metrics_file is not None:
                metrics_file.write(json.dumps({"output": output, **metrics}, allow_nan=False) + "\n")
                metrics_file.flush()
    finally:
        if metrics_file is not None:
            metrics_file.close()
    trainer.save(output)
    say(f"train-step: {counts['read']} groups in, {len(groups)} used, {counts['skipped_role']} skipped (role), "
        f"{counts['invalid']} invalid input skipped, {len(updates)} update(s), step {trainer.step} "
        f"written to {output} in {time.monotonic() - started:.1f}s [{source_name(input_path)}]")
