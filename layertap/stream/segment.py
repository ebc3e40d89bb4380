"""A producer's Mooncake segment, its pages faulted in by threads of their own before the puts need them.

Mooncake's client allocates the segment it mounts and leaves its pages untouched, so the first put into each page
faults it in (the kernel zeroes it): a put into fresh pages costs several times one into pages used before
(`benchmarks/results/put.md`, measured on an H100 host), and a run's puts land at offsets no put used before until
the segment's objects wrap. Faulting the whole segment in at once (``MADV_POPULATE_WRITE``, Linux 5.14;
``MADV_HUGEPAGE`` first, so the kernel may back it with 2 MB pages) costs those pages once, off the puts' path, while
the run starts (`benchmarks/results/gpu_stream.md` says what it changed). The segment then takes its whole size of the
host's memory for the process's life: the memory a producer lends Mooncake (``--mooncake-segment-mib``) is its own
from the start.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)
MADV_HUGEPAGE, MADV_POPULATE_WRITE = 14, 23  # <linux/mman.h>
CHUNK = 64 << 20  # one madvise call: the mm's lock is let go between chunks, so a munmap elsewhere waits on one only
THREADS = 4  # page faults of one process scale with threads (the mm's lock is shared while faulting)

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


def prefault(new: set[Region], size: int) -> threading.Event:
    """Fault in, in background threads, the mappings of ``new`` that can hold a segment of ``size`` bytes (the ones
    Mooncake's setup mapped: `anonymous_regions` after it, less those before). Returns the event that stops them
    between chunks (set it before the segment is unmounted)."""
    stop = threading.Event()
    regions = [(start, end) for start, end in new if end - start >= size]
    if not regions:
        log.info("Mooncake's segment not found among the new mappings: its pages fault in as the puts touch them")
        return stop
    madvise = _madvise()
    chunks = iter([(at, min(CHUNK, end - at)) for start, end in regions for at in range(start, end, CHUNK)])
    lock = threading.Lock()
    for start, end in regions:
        madvise(start, end - start, MADV_HUGEPAGE)  # advice: refused where THP is off, and then 4 KB pages

    def populate() -> None:
        while not stop.is_set():
            with lock:
                chunk = next(chunks, None)
            if chunk is None or madvise(*chunk, MADV_POPULATE_WRITE) != 0:
                if chunk is not None:
                    log.info("populating the Mooncake segment stopped (errno %d)", ctypes.get_errno())
                    stop.set()
                return

    for i in range(THREADS):
        threading.Thread(target=populate, name=f"segment-prefault-{i}", daemon=True).start()
    return stop


def _madvise() -> Callable[[int, int, int], int]:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc.madvise
