#!/usr/bin/env bash
# The whole test suite from a fresh machine: installs what it needs, then runs pytest.
# Tests start their own Redis, Celery workers, uvicorn and CPU SGLang servers on free ports.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
bash scripts/setup_system.sh
bash scripts/setup_sglang_cpu.sh >/dev/null
bash scripts/setup_trainers.sh
# The venvs are installed now: a test that finds one missing fails instead of skipping (tests/venvs.py).
export LAYERTAP_VENVS_REQUIRED=1
# -m "": every test, servers and all (a bare `pytest` runs only the fast lane: tests/conftest.py).
exec .venv/bin/python -m pytest -m "" "$@"
