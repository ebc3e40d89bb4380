"""Subprocesses with their output in a log file, waiting on them, and the ``layertap`` command line."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")


class ProcessExited(RuntimeError):
    """A process being waited on exited; the message holds its log's tail."""


class PortTaken(ProcessExited):
    """The process exited because another took its port between ``free_port`` and its bind."""


def wait_for(check: Callable[[], T], *, timeout: float, what: str, every: float = 0.05) -> T:
    """Poll ``check`` until it returns something truthy (returned); ``TimeoutError`` naming ``what`` after
    ``timeout`` s."""
    return wait_moving(check, moved=lambda: None, stall=timeout, what=what, every=every)


def wait_moving(
    check: Callable[[], T], *, moved: Callable[[], object], stall: float, what: str, every: float = 0.05
) -> T:
    """Poll ``check`` until it returns something truthy (returned), for as long as the work moves: ``TimeoutError``
    naming ``what`` once ``moved()`` (its progress: samples done, acks...) stayed the same for ``stall`` s. A slow
    machine is waited on; a stuck run fails as soon as on a fast one."""
    last, since = moved(), time.monotonic()
    while True:
        value = check()
        if value:
            return value
        if (now := moved()) != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since > stall:
            raise TimeoutError(f"nothing moved for {stall:.0f}s (at {now!r}) waiting for {what}")
        time.sleep(every)


@dataclass
class Proc:
    """A subprocess started from the repository root in a session of its own (so that its group can be signalled
    apart from ours), its stdout and stderr in ``log_path``."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    log_path: Path
    popen: subprocess.Popen | None = None

    def start(self) -> Proc:
        with self.log_path.open("ab") as log:  # the child holds its own descriptor
            self.popen = subprocess.Popen(
                self.cmd, env=self.env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None, f"{self.name} was never started"
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` (e.g. SIGSTOP/SIGCONT) without waiting."""
        os.kill(self.pid, sig)

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 30) -> None:
        """Send ``sig`` to the process alone and wait for it to exit (its group is SIGKILLed if it outlasts
        ``timeout``)."""
        if self.alive():
            os.kill(self.pid, sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)
                self.popen.wait(10)

    def server_pids(self) -> dict[int, str]:
        """The capture servers this process launched (pid -> URL): its children running the launcher."""
        out = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != self.pid:  # state, ppid, ...
                    continue
                cmd = (stat.parent / "cmdline").read_bytes().decode().split("\0")
                if "sglang_patch.launch" in cmd and "--port" in cmd:
                    out[int(stat.parent.name)] = f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"
        return out

    def killpg(self, sig: int = signal.SIGKILL) -> None:
        """Signal the process's group and each of its capture servers' (SGLang puts a server in a session of its
        own, so the process's group alone would miss them), and wait for the process."""
        if self.popen is None:
            return
        for pgid in [*self.server_pids(), self.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)
        self.popen.wait(timeout=60)

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return f"--- {self.name} ({self.log_path}) ---\n" + "\n".join(text.splitlines()[-lines:])


def wait_until_serving(proc: Proc, url: str, *, timeout: float, what: str) -> None:
    """Poll ``url`` until it answers 200; ``ProcessExited`` with the log at once if ``proc`` died meanwhile
    (``PortTaken`` where it died because its port was taken, so that the caller may start it on another)."""

    def ok() -> bool:
        if not proc.alive():
            said = proc.log_tail()
            raise (PortTaken if "address already in use" in said else ProcessExited)(f"{proc.name} exited\n{said}")
        try:
            return httpx.get(url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(ok, timeout=timeout, what=what, every=0.2)


# -- the layertap command line --------------------------------------------------------------------------------

LAYERTAP = (sys.executable, "-m", "layertap")  # as a user runs it, in a process of its own, from this interpreter


def layertap(*args: object, env: dict[str, str] | None = None, **popen: Any) -> subprocess.Popen:
    """``layertap ARGS`` started from the repository root (text mode); ``popen`` goes to ``subprocess.Popen``
    (``stdout=``, ``stderr=``...). Wait on it, or ``communicate``."""
    return subprocess.Popen([*LAYERTAP, *map(str, args)], env=env, cwd=REPO_ROOT, text=True, **popen)


def run_layertap(
    *args: object, env: dict[str, str] | None = None, timeout: float | None = None, log: IO[str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``layertap ARGS`` run to its end: its output captured (or written to ``log``, stderr with it)."""
    streams: dict[str, Any] = {"capture_output": True} if log is None else {"stdout": log, "stderr": subprocess.STDOUT}
    return subprocess.run([*LAYERTAP, *map(str, args)], env=env, cwd=REPO_ROOT, text=True, timeout=timeout, **streams)
