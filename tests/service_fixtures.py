"""Real services for the distributed tests (a pytest plugin listed in tests/conftest.py), over ``harness``.

- ``redis_server``: one ``redis-server`` per session on a free port in a temp folder, persistence off
  (never the system Redis on 6379); ``redis_client`` flushes it before each test.
- ``redis_factory``: more Redis servers for one test, e.g. with ``--appendonly yes`` to restart mid-job.
- ``services``: a ``harness.services.Services`` that starts real ``uvicorn coordinator.app:app`` and
  ``celery -A worker worker --pool solo`` subprocesses with the quick timings below (one engine each, one torch
  thread each: the machine has 2 cores) and kills whatever is left at the end of the test. Logs go to files whose
  tails are shown when something fails.
- ``mooncake_master``: a real ``mooncake_master`` on loopback for one test (it starts in well under a second), for
  the streams of `layertap.stream`, a run's or a job's.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from redis import Redis

from harness.mooncake import MooncakeMaster
from harness.services import RedisServer, Services
from layertap.engines.sglang import free_port

# Torch threads of every worker and coordinator process a test starts, and of the test process itself, so that
# the stores they make compute alike, byte for byte: float32 sums split over another number of threads differ in
# the last bits, a stored bf16 state then by one rounding step (and a MoE routing near-tie by an expert), and a
# comparison of a worker's store with this process's would pass or fail with the box's core count.
TORCH_THREADS = 1
torch.set_num_threads(TORCH_THREADS)
TEST_PROCESS_ENV = {"OMP_NUM_THREADS": str(TORCH_THREADS), "MKL_NUM_THREADS": str(TORCH_THREADS),
                    "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
# A test's coordinator: its watchdog runs every 0.5 s and a lost message is resent after 5 s.
TEST_COORDINATOR_ENV = {"LAYERTAP_REAPER_INTERVAL_S": "0.5", "LAYERTAP_QUEUED_GRACE_S": "5"}
# A test's worker: leases last 2 s, retries start after 0.5 s; a streaming shard's producer lends Mooncake 64 MiB (it
# faults its whole segment in at connect: the 4 GiB default, on a CI machine, for samples of a few KB).
TEST_WORKER_ENV = {"LAYERTAP_LEASE_TTL_S": "2", "LAYERTAP_RETRY_BACKOFF_S": "0.5",
                   "LAYERTAP_MOONCAKE_SEGMENT_MIB": "64"}  # fmt: skip


def quick_services(logs: Path) -> Services:
    """A ``Services`` with the tests' timings and thread counts, logging under ``logs``."""
    return Services(logs, TEST_PROCESS_ENV, TEST_COORDINATOR_ENV, TEST_WORKER_ENV)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A private Redis for the session, without persistence."""
    server = RedisServer.ephemeral(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[Redis]:
    """A client of the session Redis, flushed before the test."""
    client = Redis.from_url(redis_server.url, decode_responses=True)
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def redis_factory(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """``start(*args)`` -> a new Redis server (e.g. ``"--appendonly", "yes"``), stopped after the test."""
    started: list[RedisServer] = []

    def start(*args: str) -> RedisServer:
        folder = tmp_path / f"redis-{len(started)}"
        folder.mkdir()
        server = RedisServer(folder, free_port(), ["--save", "", *args]).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop(signal.SIGKILL)


@pytest.fixture
def mooncake_master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    """A Mooncake Store master of the test's own, stopped after it."""
    master = MooncakeMaster.ephemeral(tmp_path)
    yield master
    master.stop()


@pytest.fixture
def services(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Services]:
    """Coordinator/worker launcher for one test; on failure the logs' tails are printed."""
    logs = tmp_path / "logs"
    logs.mkdir()
    started = quick_services(logs)
    yield started
    started.stop_all()
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print(started.log_tails())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """Keep each phase's report on the test item, so fixtures can tell whether the test failed."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
