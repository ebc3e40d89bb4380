"""The coordinator is closed by default: without ``LAYERTAP_API_TOKEN`` it starts only when told the API is meant to
be open (``LAYERTAP_API_OPEN``); otherwise it refuses, in one line, before it listens. Both as settings and as real
``uvicorn coordinator.app:app`` / ``layertap coordinator`` processes over the session's Redis."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from coordinator.config import CoordinatorSettings
from harness.processes import REPO_ROOT, wait_for
from layertap.engines.sglang import free_port

REFUSAL = (
    "layertap coordinator refuses to start: LAYERTAP_API_TOKEN is not set: set it (clients send it as a bearer "
    "token), or set LAYERTAP_API_OPEN=true to serve the API to anyone who can reach it"
)


@pytest.fixture
def no_access_settings(monkeypatch) -> None:
    """Neither a token nor the open setting in this process's environment, whatever the shell had."""
    monkeypatch.delenv("LAYERTAP_API_TOKEN", raising=False)
    monkeypatch.delenv("LAYERTAP_API_OPEN", raising=False)


@pytest.mark.usefixtures("no_access_settings")
def test_the_settings_need_a_token_or_the_explicit_open_setting(tmp_path: Path) -> None:
    base = {"redis_url": "redis://127.0.0.1:1/0", "output_root": tmp_path}
    for refused in ({}, {"api_token": " "}, {"api_open": False}):
        with pytest.raises(ValidationError, match="LAYERTAP_API_TOKEN is not set"):
            CoordinatorSettings(**base, **refused)
    with pytest.raises(ValidationError, match="are both set"):
        CoordinatorSettings(**base, api_token="t", api_open=True)
    assert CoordinatorSettings(**base, api_token="t").api_token.get_secret_value() == "t"
    assert CoordinatorSettings(**base, api_open=True).api_token is None


@pytest.mark.parametrize("cli", [False, True], ids=["uvicorn", "layertap-coordinator"])
def test_a_coordinator_without_a_token_refuses_to_start_in_one_line(
    services, redis_server, tmp_path: Path, cli: bool
) -> None:
    port = free_port()
    env = services.process_env({"LAYERTAP_REDIS_URL": redis_server.url, "LAYERTAP_OUTPUT_ROOT": str(tmp_path)})
    env.pop("LAYERTAP_API_TOKEN", None)
    env.pop("LAYERTAP_API_OPEN", None)
    cmd = [sys.executable, "-m", "uvicorn", "coordinator.app:app", "--port", str(port)]
    if cli:
        cmd = [sys.executable, "-m", "layertap", "coordinator", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:

        def ended_or_serving() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                pytest.fail("the coordinator serves without a token and without LAYERTAP_API_OPEN")
            return proc.poll() is not None

        wait_for(ended_or_serving, timeout=180, what="the coordinator to refuse to start", every=0.5)
    finally:
        proc.kill()
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode != 0
    assert stderr.strip().splitlines() == [REFUSAL], stderr


def test_with_a_token_it_serves_only_callers_that_send_it(services, redis_server, tmp_path: Path) -> None:
    coordinator = services.coordinator(redis_server.url, tmp_path, token="t0ken")
    assert httpx.get(f"{coordinator.url}/jobs", timeout=30).status_code == 401
    with coordinator.client() as client:
        assert client.get("/jobs").status_code == 200
    assert "API is open" not in coordinator.proc.log_path.read_text()


def test_told_to_be_open_it_serves_anyone_and_says_so(services, redis_server, tmp_path: Path) -> None:
    coordinator = services.coordinator(redis_server.url, tmp_path, LAYERTAP_API_OPEN="true")
    assert httpx.get(f"{coordinator.url}/jobs", timeout=30).status_code == 200
    assert "LAYERTAP_API_OPEN is set: the API is open" in coordinator.proc.log_path.read_text()
