"""Training checkpoints: an HF-format model directory plus ``sptool_state/``, written atomically.

Layout of a checkpoint directory::

    OUT/
      config.json, model.safetensors, tokenizer files     (full fine-tuning), or
      adapter_config.json, adapter_model.safetensors, tokenizer files   (LoRA, peft)
      sptool_state/
        state.json      step, role(s), the training config used, base and reference model
        optimizer.pt    AdamW state (torch.save; read back with torch.load(weights_only=True))

Any HF tool (and ``sptool solve --model OUT``) loads the directory as a model; ``train-step
--model OUT`` also resumes the optimizer state and the step counter.

Writing is atomic: everything is staged in a hidden temporary directory beside OUT and renamed
into place at the end. A crash while saving leaves the input checkpoint untouched and no OUT
(at worst a hidden ``.OUT.sptool-tmp-*`` directory that the next save ignores).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from sptool.core.records import RuntimeFailure, UsageError
from sptool.core.faults import crash_during_save as _maybe_crash  # test-only fault point

STATE_DIR = "sptool_state"
STATE_FILE = "state.json"
OPTIMIZER_FILE = "optimizer.pt"
FORMAT_VERSION = 1


def is_checkpoint_dir(path: str | os.PathLike) -> bool:
    """True when ``path`` looks like a model directory sptool may replace."""
    path = Path(path)
    return path.is_dir() and any((path / name).exists() for name in
                                 (STATE_DIR, "config.json", "adapter_config.json"))


def read_state(path: str | os.PathLike) -> dict | None:
    """The ``sptool_state/state.json`` of a checkpoint, or None for a plain HF directory."""
    file = Path(path) / STATE_DIR / STATE_FILE
    if not file.is_file():
        return None
    try:
        from sptool.core.jsonl import loads_strict

        return loads_strict(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # ValueError: bad JSON, UTF-8, a refused value
        raise RuntimeFailure(f"cannot read {file}: {exc}") from None


def optimizer_state_file(path: str | os.PathLike) -> Path:
    """Where a checkpoint keeps its optimizer state (it may not exist)."""
    return Path(path) / STATE_DIR / OPTIMIZER_FILE


def load_optimizer_state(path: str | os.PathLike) -> dict | None:
    """The saved optimizer state dict (safe loading: tensors and plain containers only)."""
    import torch

    file = optimizer_state_file(path)
    if not file.is_file():
        return None
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a corrupt or unsafe file is an environment failure
        raise RuntimeFailure(f"cannot load optimizer state {file}: {str(exc).splitlines()[0]}") from None


def check_output_path(output: str | os.PathLike) -> Path:
    """Refuse an OUT that exists and is not a checkpoint (never delete a user's directory)."""
    output = Path(output)
    if output.exists() and not is_checkpoint_dir(output):
        raise UsageError(f"--output {output} exists and is not a model checkpoint; choose a new directory")
    if not output.parent.exists():
        try:  # ckpt/step-1 with no ckpt/ yet: make it, as `mkdir -p` would
            output.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"--output {output}: cannot create parent directory {output.parent}: "
                             f"{exc.strerror}") from None
    return output


def save_checkpoint(output: str | os.PathLike, *, save_model: Callable[[str], None],
                    optimizer_state: dict | None, state: dict[str, Any]) -> Path:
    """Write a checkpoint atomically.

    ``save_model(directory)`` writes the HF files (model or adapter, tokenizer) into the staging
    directory; then the optimizer state and ``state.json`` are added, and the staging directory is
    renamed to ``output``. An existing checkpoint at ``output`` (for example ``--output`` equal to
    ``--model``) is swapped out only after the new one is complete.
    """
    import torch

    output = check_output_path(output).absolute()
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.sptool-tmp-", dir=output.parent))
    try:
        save_model(str(staging))
        _maybe_crash("model weights")
        state_dir = staging / STATE_DIR
        state_dir.mkdir()
        if optimizer_state is not None:
            torch.save(optimizer_state, state_dir / OPTIMIZER_FILE)
        (state_dir / STATE_FILE).write_text(
            json.dumps({"format": FORMAT_VERSION, **state}, indent=2, ensure_ascii=False) + "\n",
            encoding="utf-8")
        _fsync_tree(staging)
        if output.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{output.name}.sptool-old-", dir=output.parent))
            os.replace(output, retired / "checkpoint")
            os.replace(staging, output)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, output)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        disk_full = _disk_full(error, output)
        if disk_full is not None:
            raise disk_full from None
        raise
    return output


# How a full disk shows up from writers that do not raise OSError: torch.save's zip writer
# ("unexpected pos N vs M", "file write failed") and safetensors' Rust writer (os error 28).
_DISK_FULL_MARKERS = ("No space left on device", "StorageFull", "os error 28", "unexpected pos",
                      "file write failed")


def _disk_full(error: BaseException, output: Path) -> OSError | None:
    """The ENOSPC ``OSError`` (one line and exit 1 at the CLI) for a checkpoint writer's
    full-disk failure that is not an ``OSError`` itself; None for anything else."""
    if isinstance(error, OSError) or not isinstance(error, Exception):
        return None
    if not any(marker in str(error) for marker in _DISK_FULL_MARKERS):
        return None
    return OSError(errno.ENOSPC, f"No space left on device (writing the checkpoint: "
                                 f"{type(error).__name__})", str(output))


def _fsync_tree(root: Path) -> None:
    for directory, _, files in os.walk(root):
        for name in files:
            try:
                fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
