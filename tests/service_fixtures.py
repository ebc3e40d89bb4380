"""Real services for the distributed tests (a pytest plugin listed in tests/conftest.py).

- ``redis_server``: one ``redis-server`` per session on a free port in a temp folder, persistence off
  (never the system Redis on 6379); ``redis_client`` flushes it before each test.
- ``redis_factory``: more Redis servers for one test, e.g. with ``--appendonly yes`` to restart mid-job.
- ``services``: starts real ``uvicorn coordinator.app:app`` and ``celery -A worker worker --pool solo``
  subprocesses (one engine each, one torch thread each: the machine has 2 cores) and kills whatever
  is left at the end of the test. Logs go to files whose tails are shown when something fails.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import torch
from redis import Redis

from layertap.engines.sglang.process import free_port  # one definition: the product's

REPO_ROOT = Path(__file__).resolve().parents[1]
# Torch threads of every worker and coordinator process a test starts, and of the test process itself, so that
# the stores they make compute alike, byte for byte: float32 sums split over another number of threads differ in
# the last bits, a stored bf16 state then by one rounding step (and a MoE routing near-tie by an expert), and a
# comparison of a worker's store with this process's would pass or fail with the box's core count.
TORCH_THREADS = 1
torch.set_num_threads(TORCH_THREADS)
REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def wait_for(check: Callable[[], object], *, timeout: float, what: str, every: float = 0.05) -> object:
    """Poll ``check`` until it returns something truthy; fail the test with ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)


class PortTaken(Exception):
    """The process exited because another took its port between ``free_port`` and its bind."""


def wait_until_serving(proc: Proc, url: str, *, timeout: float, what: str) -> None:
    """Poll ``url`` until it answers 200; fail at once, with the log, if ``proc`` died meanwhile (``PortTaken``
    where it died because its port was taken, so that the caller may start it on another)."""

    def ok() -> bool:
        if not proc.alive():
            said = proc.log_tail()
            if "address already in use" in said:
                raise PortTaken(said)
            pytest.fail(f"{proc.name} exited\n{said}")
        try:
            return httpx.get(url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(ok, timeout=timeout, what=what, every=0.2)


@dataclass
class Proc:
    """A subprocess with its output in a log file."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    log_path: Path
    popen: subprocess.Popen | None = None

    def start(self) -> Proc:
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        self.popen = subprocess.Popen(
            self.cmd, env=self.env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` (e.g. SIGSTOP/SIGCONT) without waiting."""
        os.kill(self.pid, sig)

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 30) -> None:
        """Send ``sig`` to the process alone and wait for it to exit."""
        if self.alive():
            os.kill(self.pid, sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)
                self.popen.wait(10)

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return f"--- {self.name} ({self.log_path}) ---\n" + "\n".join(text.splitlines()[-lines:])


@dataclass
class RedisServer:
    """A redis-server of our own; ``restart`` keeps its port and folder (and so its AOF, when on)."""

    dir: Path
    port: int
    args: list[str]
    proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        cmd = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir), *self.args]
        self.proc = Proc(f"redis:{self.port}", cmd, dict(os.environ), self.dir / "redis.log").start()
        client = Redis(port=self.port, socket_connect_timeout=1)

        def ready() -> bool:
            try:
                return bool(client.ping())
            except Exception:
                return False

        wait_for(ready, timeout=20, what=f"redis-server on port {self.port}")
        client.close()
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """SIGTERM shuts down cleanly (an AOF is flushed first); SIGKILL loses what was not yet fsynced."""
        if self.proc is not None:
            self.proc.kill(sig)

    def restart(self, sig: int = signal.SIGTERM) -> None:
        self.stop(sig)
        self.start()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A private Redis for the session, without persistence."""
    server = RedisServer(tmp_path_factory.mktemp("redis"), free_port(), ["--save", "", "--appendonly", "no"]).start()
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


@dataclass
class Coordinator:
    proc: Proc
    url: str
    token: str | None

    def client(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)


@dataclass
class Services:
    """Starts coordinator and worker subprocesses for one test; everything left is killed at the end."""

    logs: Path
    procs: list[Proc] = field(default_factory=list)

    def _env(self, extra: dict[str, str]) -> dict[str, str]:
        env = dict(os.environ)
        threads = str(TORCH_THREADS)
        env.update({"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads})
        env.update({"TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
        env.update(extra)
        return env

    def coordinator(
        self,
        redis_url: str,
        output_root: Path,
        *,
        port: int | None = None,
        token: str | None = None,
        cli: bool = False,
        **env: str,
    ) -> Coordinator:
        """A coordinator (``uvicorn coordinator.app:app``, or ``layertap coordinator`` with ``cli``), closed by
        ``token`` or else explicitly open; its watchdog runs every 0.5 s and a lost message is resent after 5 s."""
        settings = {
            "LAYERTAP_REDIS_URL": redis_url,
            "LAYERTAP_OUTPUT_ROOT": str(output_root),
            "LAYERTAP_REAPER_INTERVAL_S": "0.5",
            "LAYERTAP_QUEUED_GRACE_S": "5",
            "LAYERTAP_API_TOKEN": token or "",
            "LAYERTAP_API_OPEN": "false" if token else "true",  # no token: open on purpose (127.0.0.1 only)
            **env,
        }
        entry = ["layertap", "coordinator"] if cli else ["uvicorn", "coordinator.app:app"]
        taken = 0
        while True:
            chosen = port or free_port()
            cmd = [sys.executable, "-m", *entry, "--host", "127.0.0.1", "--port", str(chosen)]
            log = self.logs / f"coordinator-{chosen}.log"
            proc = Proc(f"coordinator:{chosen}", cmd, self._env(settings), log).start()
            self.procs.append(proc)
            coordinator = Coordinator(proc, f"http://127.0.0.1:{chosen}", token)
            try:
                wait_until_serving(proc, f"{coordinator.url}/health", timeout=90, what="the coordinator's /health")
                return coordinator
            except PortTaken as error:
                taken += 1
                if port or taken == 3:  # the test's own port, or three taken in a row
                    pytest.fail(f"{proc.name} exited: its port was taken\n{error}")

    def worker(self, name: str, redis_url: str, *, wait: bool = True, **env: str) -> Proc:
        """A ``celery -A worker worker --pool solo`` process: leases last 2 s, retries start after 0.5 s."""
        settings = {
            "LAYERTAP_REDIS_URL": redis_url,
            "LAYERTAP_WORKER_NAME": name,
            "LAYERTAP_LEASE_TTL_S": "2",
            "LAYERTAP_RETRY_BACKOFF_S": "0.5",
            **env,
        }
        cmd = [sys.executable, "-m", "celery", "-A", "worker", "worker", "--pool", "solo", "-n", f"{name}@%h",
               "--loglevel", "INFO", "--without-gossip", "--without-mingle", "--without-heartbeat"]  # fmt: skip
        proc = Proc(f"worker:{name}", cmd, self._env(settings), self.logs / f"worker-{name}.log").start()
        self.procs.append(proc)
        if wait:
            self.wait_ready(proc)
        return proc

    def wait_ready(self, proc: Proc) -> None:
        def ready() -> bool:
            if not proc.alive():
                pytest.fail(f"{proc.name} exited\n{proc.log_tail()}")
            return " ready." in proc.log_path.read_text(errors="replace")

        wait_for(ready, timeout=120, what=f"{proc.name} to be ready", every=0.2)

    def log_tails(self) -> str:
        return "\n".join(p.log_tail() for p in self.procs)

    def stop_all(self) -> None:
        for proc in self.procs:
            proc.kill(signal.SIGKILL)


@pytest.fixture
def services(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Services]:
    """Coordinator/worker launcher for one test; on failure the logs' tails are printed."""
    logs = tmp_path / "logs"
    logs.mkdir()
    started = Services(logs)
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
