"""What a worker is doing (idle, working, paused and why), and the free-space guard that pauses it.

The guard is asked before every sample. Below the floor (``LAYERTAP_MIN_FREE_BYTES``) it blocks:
no new request goes out, the heartbeat keeps the shard's lease, the worker's Redis record and its
metrics say ``paused`` with the reason, and it goes on once free space is back above the resume
mark (a little above the floor, so a worker at the edge does not flap). A cancelled job ends the
pause at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from layertap.diskspace import free_bytes, human_bytes
from worker.metrics import STATES, State, WorkerMetrics

log = logging.getLogger(__name__)

FreeSpaceProbe = Callable[[Path], int]


class WorkerStatus:
    """The process's state, mirrored into its metrics at once and into its Redis record by the heartbeat."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics
        self.state: State = "idle"
        self.reason = ""
        self.free_bytes: int | None = None
        self.on_change: Callable[[], None] | None = None  # e.g. an immediate heartbeat
        self._lock = threading.Lock()
        self.set("idle")

    def set(self, state: State, reason: str = "") -> None:
        with self._lock:
            self.state, self.reason = state, reason
            for name in STATES:
                self.metrics.states[name].set(1 if name == state else 0)
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception as exc:  # the record is refreshed by the next heartbeat anyway
                log.warning("could not publish the worker state now: %s", exc)

    @contextmanager
    def working(self) -> Iterator[None]:
        self.set("working")
        try:
            yield
        finally:
            self.set("idle")

    def record(self) -> dict[str, str | int]:
        """Fields for the worker's Redis record."""
        with self._lock:
            free = "" if self.free_bytes is None else self.free_bytes
            return {"state": self.state, "reason": self.reason, "free_bytes": free}


class DiskGuard:
    """Pauses the calling thread while the output volume is below the floor."""

    def __init__(
        self,
        status: WorkerStatus,
        *,
        min_free_bytes: int,
        resume_free_bytes: int,
        check_s: float,
        probe: FreeSpaceProbe = free_bytes,
    ) -> None:
        self.status = status
        self.metrics = status.metrics
        self.min_free_bytes = min_free_bytes
        self.resume_free_bytes = max(resume_free_bytes, min_free_bytes)
        self.check_s = check_s
        self.probe = probe
        self._checked: tuple[Path, float, int] | None = None  # (path, when, free bytes)
        self.metrics.min_free_bytes.set(min_free_bytes)

    def free(self, path: Path, *, fresh: bool = False) -> int:
        """Free bytes under ``path``, read at most every ``check_s`` unless ``fresh``."""
        now = time.monotonic()
        if not fresh and self._checked and self._checked[0] == path and now - self._checked[1] < self.check_s:
            return self._checked[2]
        free = self.probe(path)
        self._checked = (path, now, free)
        self.status.free_bytes = free
        self.metrics.free_bytes.set(free)
        return free

    def wait_for_space(self, path: Path, still_wanted: Callable[[], bool]) -> bool:
        """Return True at once if ``path``'s volume is above the floor; else pause until it is back above
        the resume mark (True) or ``still_wanted()`` turns False (False: stop the shard)."""
        free = self.free(path)
        if free >= self.min_free_bytes:
            return True
        reason = (
            f"low disk: {human_bytes(free)} free on {path}, below the floor of {human_bytes(self.min_free_bytes)}; "
            f"resuming above {human_bytes(self.resume_free_bytes)}"
        )
        log.warning("paused: %s", reason)
        self.metrics.paused["low_disk"].set(1)
        self.status.set("paused", reason)
        try:
            while True:
                time.sleep(self.check_s)
                if not still_wanted():
                    log.info("pause ended: the shard is no longer wanted")
                    return False
                free = self.free(path, fresh=True)
                if free >= self.resume_free_bytes:
                    log.info("resumed: %s free on %s", human_bytes(free), path)
                    return True
        finally:
            self.metrics.paused["low_disk"].set(0)
            self.status.set("working")
