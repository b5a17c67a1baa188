"""``sptool export``: a run's checkpoint as a plain Hugging Face model directory with a model card.

The newest complete checkpoint of a role (or ``step``) is written to ``output`` as what
``AutoModelForCausalLM.from_pretrained``, lm-eval and vLLM load: the model files and the
tokenizer, without sptool's training state (``sptool_state/``: optimizer, step). A LoRA checkpoint
is merged into its base model (``merge``), or kept as a peft adapter directory. ``README.md``
records the base model, the recipe and its settings (``config.toml``), the data sources and their
sha256, the held-out curve (``metrics.jsonl``) and the sptool version, and shows the
``huggingface-cli upload`` line (nothing is uploaded). The directory is staged beside ``output``
and renamed into place: a failed export leaves nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from sptool.core.records import UsageError

TINY_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_SKIP = {"sptool_state"}


def checkpoints(run_dir: Path, role: str) -> dict[int, Path]:
    """The complete checkpoints of ``role``: step -> directory."""
    from sptool.run.checkpoints import is_complete

    found = {}
    for path in (run_dir / "ckpt" / role).glob("step-*"):
        match = re.fullmatch(r"step-(\d+)", path.name)
        if match and path.is_dir() and is_complete(path):
            found[int(match.group(1))] = path
    return found


def pick_checkpoint(run_dir: Path, role: str | None, step: int | None) -> tuple[str, int, Path]:
    """(role, step, directory) of the checkpoint to export; a usage error names what there is."""
    if not (run_dir / "config.toml").is_file():
        raise UsageError(f"{run_dir}: no config.toml (not a `sptool run` directory?)")
    roles = sorted(p.name for p in (run_dir / "ckpt").glob("*") if p.is_dir() and checkpoints(run_dir, p.name))
    if not roles:
        raise UsageError(f"{run_dir}: no finished checkpoint under ckpt/ (the run wrote none yet)")
    if role is None:
        for preferred in ("policy", "solver"):
            if preferred in roles:
                role = preferred
                break
        else:
            if len(roles) > 1:
                raise UsageError(f"{run_dir}: several roles, choose one with --role ({', '.join(roles)})")
            role = roles[0]
    if role not in roles:
        raise UsageError(f"{run_dir}: no checkpoint of role {role!r} (roles: {', '.join(roles)})")
    found = checkpoints(run_dir, role)
    if step is None:
        step = max(found)
    if step not in found:
        raise UsageError(f"{run_dir}: no checkpoint of {role} at step {step} "
                         f"(steps: {', '.join(str(s) for s in sorted(found))})")
    return role, step, found[step]


def _copy_model(checkpoint: Path, staging: Path) -> None:
    for item in checkpoint.iterdir():
        if item.name in _SKIP or item.name.startswith("."):
            continue
        if item.is_dir():
            shutil.copytree(item, staging / item.name)
        else:
            shutil.copy2(item, staging / item.name)


def _merge_adapter(checkpoint: Path, staging: Path) -> str:
    """Merge a peft LoRA adapter into its base model and save the result; returns the base."""
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM

    from sptool.models.tokenizer import load_tokenizer

    base = PeftConfig.from_pretrained(str(checkpoint)).base_model_name_or_path
    model = AutoModelForCausalLM.from_pretrained(base)
    merged = PeftModel.from_pretrained(model, str(checkpoint)).merge_and_unload()
    merged.save_pretrained(str(staging))
    load_tokenizer(str(checkpoint)).save_pretrained(str(staging))
    return base


def export_run(run_dir: str | os.PathLike, output: str | os.PathLike, *, role: str | None = None,
               step: int | None = None, merge: bool = True, log: Callable[[str], None] | None = None) -> dict:
    """Export a checkpoint of ``run_dir`` to ``output`` (see the module); returns what was written."""
    from sptool.train.checkpoint import read_state

    run_dir, output = Path(run_dir), Path(output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise UsageError(f"--output {output} exists and is not empty; choose a new directory")
    role, step, checkpoint = pick_checkpoint(run_dir, role, step)
    adapter = (checkpoint / "adapter_config.json").is_file()
    state = read_state(checkpoint) or {}
    config = _read_config(run_dir)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.sptool-tmp-", dir=output.parent))
    try:
        if adapter and merge:
            if log:
                log(f"export: merging the LoRA adapter of {checkpoint} into its base model")
            _merge_adapter(checkpoint, staging)
            kind = "merged LoRA"
        else:
            _copy_model(checkpoint, staging)
            kind = "LoRA adapter (peft)" if adapter else "full weights"
        card = model_card(run_dir, config, state, role=role, step=step, kind=kind, output=output)
        (staging / "README.md").write_text(card, encoding="utf-8")
        if output.exists():
            output.rmdir()  # empty (checked above)
        os.replace(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return {"output": str(output), "role": role, "step": step, "checkpoint": str(checkpoint), "kind": kind}


def _read_config(run_dir: Path) -> dict:
    import tomllib

    try:
        return tomllib.loads((run_dir / "config.toml").read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"{run_dir / 'config.toml'}: cannot read ({exc})") from None


def _base_model(config: dict, state: dict, role: str) -> str:
    model = config.get("model", {})
    start = model.get(role) or model.get("policy") or state.get("base_model") or "?"
    from sptool.models.resolve import TINY_NAMES

    return TINY_HUB_ID if str(start).lower() in TINY_NAMES else str(start)


def data_sources(config: dict) -> list[tuple[str, str, str]]:
    """(what, source, sha256 or a note) of every problem set the run's settings name."""
    from sptool.stages.problemsets.sources import source_sha256

    recipe = config.get("recipe", "")
    named: list[tuple[str, str]] = []
    section = config.get(recipe, {})
    for key, what in (("data", "training set (--data)"), ("init_data", "validity initialisation")):
        if section.get(key):
            named.append((what, section[key]))
    for key, what in (("eval", "held-out benchmark"), ("decontaminate", "decontamination benchmark")):
        for spec in str(config.get(key, {}).get("benchmarks", "")).split(","):
            if spec.strip():
                named.append((what, spec.strip()))
    if config.get("health", {}).get("probe"):
        named.append(("health probe", config["health"]["probe"]))
    out = []
    for what, spec in named:
        digest = source_sha256(spec)
        out.append((what, spec, digest or "not found when exporting"))
    return out


def heldout_curve(run_dir: Path) -> list[dict]:
    """The ``eval`` lines of metrics.jsonl: after_iteration and each benchmark's scores."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    from sptool.run.run_dir import read_jsonl  # a run file: no record kind's checks ("samples": 32)

    return [line for line in read_jsonl(path) if isinstance(line, dict) and line.get("kind") == "eval"]


def _looks_like_hub_id(name: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name)) and not os.path.exists(name)


def model_card(run_dir: Path, config: dict, state: dict, *, role: str, step: int, kind: str,
               output: Path) -> str:
    """The exported directory's README.md (a Hugging Face model card)."""
    from sptool import __version__

    recipe = config.get("recipe", "?")
    base = _base_model(config, state, role)
    front = ["---", "library_name: transformers"]
    if _looks_like_hub_id(base):
        front.append(f"base_model: {base}")
    tags = dict.fromkeys(["sptool", recipe, "reinforcement-learning", "rlvr"])
    front += ["tags:", *[f"- {tag}" for tag in tags], "---", ""]
    lines = [*front, f"# {output.name}", "",
             f"Trained with sptool {__version__}, recipe `{recipe}`: "
             f"role `{role}`, checkpoint step {step} ({kind}), exported from `{run_dir}`.", "",
             "## Base model", "", f"`{base}`" + (" (the built-in tiny model, SmolLM2-135M-Instruct "
                                                 "dequantised from its Q4_1 GGUF)" if base == TINY_HUB_ID else ""), ""]
    lines += ["## Data", ""]
    sources = data_sources(config)
    mapping = {k: v for k, v in config.get("data", {}).items() if v}
    if sources:
        lines += ["| use | source | sha256 |", "|---|---|---|"]
        lines += [f"| {what} | `{spec}` | `{digest}` |" for what, spec, digest in sources]
    else:
        lines.append("No labelled problem set (the questions were generated during the run).")
    if mapping:
        lines += ["", "Column mapping: " + ", ".join(f"`data.{k} = {v}`" for k, v in mapping.items())]
    lines += ["", "## Held-out curve", ""]
    curve = heldout_curve(run_dir)
    if curve:
        metrics = sorted({m for line in curve for scores in line.get("benchmarks", {}).values() for m in scores},
                         key=lambda m: (m != "greedy", m))
        lines += ["| after iteration | benchmark | " + " | ".join(metrics) + " |",
                  "|---|---|" + "---|" * len(metrics)]
        for line in curve:
            for name, scores in line.get("benchmarks", {}).items():
                cells = [f"{scores[m]:.3f}" if isinstance(scores.get(m), (int, float)) else "-" for m in metrics]
                lines.append(f"| {line.get('after_iteration')} | {name} | " + " | ".join(cells) + " |")
    else:
        lines.append("No held-out evaluation in this run (`--eval FILE` adds one).")
    config_text = (run_dir / "config.toml").read_text(encoding="utf-8").strip()
    lines += ["", "## Recipe and settings", "", f"`sptool run --recipe {recipe}` with this configuration "
              "(the run's `config.toml`):", "", "```toml", config_text, "```", "",
              "## Use", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
              f'model = AutoModelForCausalLM.from_pretrained("{output.name}")',
              f'tokenizer = AutoTokenizer.from_pretrained("{output.name}")', "```", "",
              "Upload (not done by sptool):", "", "```bash",
              f"huggingface-cli upload YOUR-NAME/{output.name} {output} .", "```", ""]
    return "\n".join(lines)
