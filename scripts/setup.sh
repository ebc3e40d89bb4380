#!/usr/bin/env bash
# Create the project venv (.venv) and install layertap with its dev tools and its streaming extra. Idempotent.
# The SGLang server has its own venv (scripts/setup_sglang_cpu.sh); the two never share packages.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
stamp=.venv/.layertap-installed
if [[ ! -f "$stamp" || pyproject.toml -nt "$stamp" ]]; then
  .venv/bin/pip install --quiet --upgrade pip
  .venv/bin/pip install --quiet -e ".[dev,stream]"
  touch "$stamp"
fi
