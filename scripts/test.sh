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
# Two pytest-xdist workers, a test module each at a time (its module fixtures built once; modules sharing servers
# together: tests/conftest.py's SHARE_SERVERS): a serial run keeps the 2-core box under half busy (it waits on server
# starts, Celery and timeouts); CONTRIBUTING.md has the measured times.
# LAYERTAP_TEST_WORKERS=0 runs serially.
exec .venv/bin/python -m pytest -m "" -n "${LAYERTAP_TEST_WORKERS:-2}" --dist loadfile "$@"
