"""A producer's Mooncake segment, its pages faulted in by threads of their own ahead of the puts.

Mooncake's client allocates the segment it mounts and leaves its pages untouched, so the first put into each page
faults it in (the kernel zeroes it): a put into fresh pages costs several times one into pages used before
(`benchmarks/results/put.md`, measured on an H100 host), and a run's puts land at offsets no put used before until
the segment's objects wrap. `Prefault` faults the pages in from the segment's start (``MADV_POPULATE_WRITE``, Linux
5.14; ``MADV_HUGEPAGE`` first, so the kernel may back it with 2 MB pages), off the puts' path, ``LOOKAHEAD`` bytes
past the most the segment has held at once: Mooncake's allocator carves each new object from the lowest free offset,
and a consumer removes each object it is done with, so the objects stay near the segment's start (a producer's bound
of unacked samples keeps them there). A run does not pay for pages it never uses: on a small machine, faulting in a
whole segment held a short run back, and a long run faulted in all of it while it ran. What was faulted in stays the
process's until the segment is unmounted. `benchmarks/results/gpu_stream.md` as of 601a115 (against
`gpu_stream_before_prefault.md`) says what faulting in changed.

A producer beside its capture server mounts its segment from a file in the server's dump root instead (`MappedFile`):
the server writes each sample into it where the producer reserved its object, and nothing is copied after.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglang_patch.contract import SEGMENT_PREFIX
from sglang_patch.segments import MADV_HUGEPAGE, MADV_POPULATE_WRITE, madvise

log = logging.getLogger(__name__)
CHUNK = 64 << 20  # one madvise call: the mm's lock is let go between chunks, so a munmap elsewhere waits on one only
LOOKAHEAD = 1 << 30  # ~25 samples of 4 states at Kimi-K2's width: faulted in ahead in well under a second
# Page faults of one process scale with threads (the mm's lock is shared while faulting), up to half the host's cores:
# on a 2-core box, four of them beside a put once stalled it 0.57 s.
THREADS = max(1, min(4, (os.cpu_count() or 2) // 2))

Region = tuple[int, int]


def anonymous_regions() -> set[Region]:
    """The process's private anonymous read-write mappings, as (start, end) addresses."""
    regions = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) == 5 and fields[1] == "rw-p":  # no path: anonymous
            start, end = (int(address, 16) for address in fields[0].split("-"))
            regions.add((start, end))
    return regions


class Prefault:
    """Threads that fault in, in address order, the mappings of ``regions`` (those Mooncake's setup mapped:
    `anonymous_regions` after it, less those before, that can hold the segment), up to ``LOOKAHEAD`` bytes past the
    most the segment held at once (`advance` on each put, `retire` once its object is removed). `stop` before the
    segment is unmounted."""

    def __init__(self, regions: list[Region]) -> None:
        self.chunks = [(at, min(CHUNK, end - at)) for start, end in sorted(regions) for at in range(start, end, CHUNK)]
        self.taken = self.done = 0  # chunks handed to a thread, chunks faulted in
        self.held = 0  # bytes of the objects put and not yet removed
        self.wanted = LOOKAHEAD  # bytes from the segment's start to have faulted in
        self.stopped = False
        self.cond = threading.Condition()
        if not self.chunks:  # nothing to fault in: the pages fault in as the puts touch them
            return
        advise = madvise()
        for start, end in regions:
            advise(start, end - start, MADV_HUGEPAGE)  # advice: refused where THP is off, and then 4 KB pages
        for i in range(THREADS):
            threading.Thread(target=self._populate, args=(advise,), name=f"segment-prefault-{i}", daemon=True).start()

    def advance(self, nbytes: int) -> None:
        """``nbytes`` more are being put into the segment."""
        with self.cond:
            self.held += nbytes
            if self.held + LOOKAHEAD > self.wanted:
                self.wanted = self.held + LOOKAHEAD
                self.cond.notify_all()

    def retire(self, nbytes: int) -> None:
        """``nbytes`` put before are gone from the segment (their objects removed, or their puts failed)."""
        with self.cond:
            self.held -= nbytes

    def wait(self, timeout: float) -> bool:
        """Until the pages asked for so far are faulted in (or the threads stopped); False when ``timeout`` passed."""
        with self.cond:
            asked = min(len(self.chunks), -(-self.wanted // CHUNK))
            return self.cond.wait_for(lambda: self.stopped or self.done >= asked, timeout)

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()

    def _populate(self, madvise: Callable[[int, int, int], int]) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(
                    lambda: self.stopped or self.taken * CHUNK < self.wanted or self.taken == len(self.chunks)
                )
                if self.stopped or self.taken == len(self.chunks):
                    return
                chunk = self.chunks[self.taken]
                self.taken += 1
            if madvise(*chunk, MADV_POPULATE_WRITE) != 0:
                log.info("faulting the Mooncake segment in stopped (errno %d)", ctypes.get_errno())
                self.stop()
                return
            with self.cond:
                self.done += 1
                self.cond.notify_all()


def prefault(new: set[Region], size: int) -> Prefault:
    """A `Prefault` of the mappings of ``new`` that can hold a segment of ``size`` bytes (none found: one that does
    nothing, the pages then faulting in as the puts touch them)."""
    regions = [(start, end) for start, end in new if end - start >= size]
    if not regions:
        log.info("Mooncake's segment not found among the new mappings: its pages fault in as the puts touch them")
    return Prefault(regions)


@dataclass(frozen=True, slots=True)
class MappedFile:
    """A producer's segment mounted from a file, ``<folder>/.segment-<host>-<pid>-<nonce>``, in the folder its capture
    server writes into (its dump root, on tmpfs for a run that writes nothing to disk), mapped here at ``start``.
    `connect`'s `disconnect` removes it; one a killed producer left goes when the next producer on its host mounts
    one there (`sweep_segments`): tmpfs would hold its pages for good."""

    path: Path
    start: int
    size: int

    @classmethod
    def mount(cls, client: Any, folder: Path, size: int) -> MappedFile:
        """The file made, sized and mounted as ``client``'s segment; RuntimeError when Mooncake refuses it."""
        folder.mkdir(parents=True, exist_ok=True)
        if swept := sweep_segments(folder):
            log.warning("removed %d Mooncake segment files of producers no longer running from %s", swept, folder)
        path = folder / f"{SEGMENT_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        if (status := client.mount_segment(str(path), size, 0, "tcp", "").get("ret")) != 0:
            path.unlink()
            raise RuntimeError(f"Mooncake refused the segment file {path} (status {status})")
        for line in Path("/proc/self/maps").read_text().splitlines():
            if line.endswith(f" {path}"):
                return cls(path, int(line.split("-")[0], 16), size)
        raise RuntimeError(f"Mooncake mounted {path} without mapping it here")

    def offset(self, address: int) -> int:
        """Where ``address`` (in this process's mapping) lies in the file."""
        if not self.start <= address < self.start + self.size:
            raise RuntimeError(f"address {address:#x} lies outside the segment file {self.path}")
        return address - self.start


def sweep_segments(folder: Path) -> int:
    """Remove the segment files in ``folder`` of this host's producers that are gone; returns how many."""
    removed, ours = 0, f"{SEGMENT_PREFIX}{socket.gethostname()}-"
    for path in folder.glob(f"{ours}*"):
        pid = path.name.removeprefix(ours).split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True
