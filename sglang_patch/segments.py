"""The server's side of a placed sample: stream producers' segment files, mapped shared, written into by the writers.

A placed sample is stored into a shared mapping of its producer's segment file, not written with ``pwrite``: writes
into one file queue on its inode's lock, one writer thread at a time, while the file dumps' writers each write a file
of their own side by side (on an H100 host a placed write took 57-63 ms a sample against 34 ms for a file dump,
`benchmarks/results/gpu_stream_pwrite.md`; stored into a mapping, 15.5-16.4 ms against 19-20 ms, `gpu_stream.md`);
stores into a mapping take no lock of the file's. The sample's pages
are faulted in first in one call (``MADV_POPULATE_WRITE``), not a trap per page, and the copies are torch's, which let
go of the GIL the scheduler's loop holds.

Each file is mapped once and kept while it is there: tmpfs keeps a removed file's pages while any process maps it, so
a mapping whose file its producer removed goes as soon as no writer is using it (`Segments.sweep`, which the writers
run when idle and before each placed write).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from sglang_patch.contract import Placement

MADV_HUGEPAGE, MADV_POPULATE_WRITE = 14, 23  # <linux/mman.h>
PAGE = mmap.PAGESIZE


def madvise() -> Callable[[int, int, int], int]:
    """libc's madvise(address, length, advice), called without the GIL (ctypes lets go of it); errno kept."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc.madvise


@dataclass(slots=True)
class _Mapping:
    fd: int
    mm: mmap.mmap
    address: int
    users: int = 0


class Segments:
    """The segment files this process writes placed samples into, each mapped once (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: dict[tuple[int, int], _Mapping] = {}  # (st_dev, st_ino) -> its mapping
        self._madvise = madvise()

    def write(self, place: Placement, tensors: dict[str, torch.Tensor]) -> None:
        """Write each tensor at its span of ``place`` (the gaps zeroed); ValueError, with no byte written, when the
        tensors are not those the placement was made for (names, sizes) or its file does not hold it."""
        sizes = {name: t.nbytes for name, t in tensors.items()}
        if sizes != place.sizes:
            raise ValueError(f"the sample's tensors ({sizes} bytes) do not fit its placement {place.tensors}")
        with self._span(place) as span:
            end = 0
            for name, (start, nbytes) in sorted(place.tensors.items(), key=lambda item: item[1]):
                span[end:start].zero_()
                span[start : start + nbytes].copy_(tensors[name].contiguous().reshape(-1).view(torch.uint8))
                end = start + nbytes
            span[end:].zero_()

    def sweep(self) -> None:
        """Unmap the files their producers removed that no writer is using."""
        with self._lock:
            for key, mapping in list(self._maps.items()):
                if mapping.users == 0 and os.fstat(mapping.fd).st_nlink == 0:
                    del self._maps[key]
                    mapping.mm.close()
                    os.close(mapping.fd)

    def mapped(self) -> int:
        """How many files are mapped now."""
        with self._lock:
            return len(self._maps)

    @contextlib.contextmanager
    def _span(self, place: Placement) -> Iterator[torch.Tensor]:
        """Bytes ``[offset, offset + size)`` of the placement's file as a uint8 tensor, faulted in, its mapping kept
        while inside."""
        mapping = self._acquire(place.path)
        try:
            if len(mapping.mm) < place.offset + place.size:
                raise ValueError(f"{place.path} ends before the placement's {place.offset + place.size} bytes")
            start = (mapping.address + place.offset) // PAGE * PAGE
            self._madvise(start, mapping.address + place.offset + place.size - start, MADV_POPULATE_WRITE)
            yield torch.frombuffer(mapping.mm, dtype=torch.uint8, count=place.size, offset=place.offset)
        finally:
            with self._lock:
                mapping.users -= 1

    def _acquire(self, path: str) -> _Mapping:
        """The mapping of the file now at ``path`` (mapped if new to this process), one more user counted."""
        self.sweep()
        fd = os.open(path, os.O_RDWR)
        stat = os.fstat(fd)
        key = (stat.st_dev, stat.st_ino)
        with self._lock:
            if key not in self._maps and stat.st_size > 0:
                mm = mmap.mmap(fd, stat.st_size)
                address = ctypes.addressof(ctypes.c_char.from_buffer(mm))  # the export ends with the temporary
                self._maps[key] = _Mapping(fd, mm, address)
            else:
                os.close(fd)
            if (mapping := self._maps.get(key)) is None:
                raise ValueError(f"{path} is empty: no placement lies in it")
            mapping.users += 1
            return mapping
