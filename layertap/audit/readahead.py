"""Reading a folder's decoder layers in order, one layer ahead of the computation, in a thread.

The streamed reference reads the whole folder once (554 GB for Kimi-K2.5): its time is at least that read, so the
read overlaps the computation. At most two layers are in host memory as stored (packed INT4 experts stay packed):
the one being computed and the next, read meanwhile. The rates are kept so the audit can say whether it waited on
the disk.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from layertap.diskspace import human_bytes
from layertap.models.weights import FolderWeights, Stored, nbytes


@dataclass(slots=True)
class ReadStats:
    """What reading cost: bytes read, seconds the reader spent reading, seconds the computation waited for it."""

    bytes: int = 0
    read_seconds: float = 0.0
    wait_seconds: float = 0.0

    @property
    def rate(self) -> float:
        """Bytes per second while reading."""
        return self.bytes / self.read_seconds if self.read_seconds else 0.0

    def summary(self) -> str:
        return (
            f"read {human_bytes(self.bytes)} of weights at {human_bytes(self.rate)}/s "
            f"({self.read_seconds:.1f}s reading, {self.wait_seconds:.1f}s of it waited for)"
        )


class ReadAhead:
    """``for index, tensors in ReadAhead(weights, layers)``: each layer's tensors as stored (plain names without the
    ``model.layers.N.`` prefix), the next layer read while the caller computes this one. The caller drops a layer's
    tensors before asking for the next; an error in the reader is raised in the caller."""

    def __init__(self, weights: FolderWeights, layers: Sequence[int]) -> None:
        self.weights = weights
        self.layers = list(layers)
        self.stats = ReadStats()
        self._ready: queue.Queue = queue.Queue()
        self._slots = threading.Semaphore(2)  # the layer being computed and the one read ahead
        self._stop = threading.Event()

    def read(self, names: Sequence[str]) -> dict[str, Stored]:
        """Tensors ``names`` as stored, read now, counted in the stats."""
        started = time.perf_counter()
        tensors = self.weights.read_stored(names)
        self.stats.read_seconds += time.perf_counter() - started
        self.stats.bytes += sum(nbytes(t) for t in tensors.values())
        return tensors

    def _reader(self) -> None:
        try:
            for index in self.layers:
                self._slots.acquire()
                if self._stop.is_set():
                    return
                prefix = f"model.layers.{index}."
                tensors = self.read(self.weights.layer(index))
                self._ready.put((index, {name.removeprefix(prefix): t for name, t in tensors.items()}))
        except BaseException as exc:  # handed to the caller, which raises it
            self._ready.put(exc)

    def __iter__(self) -> Iterator[tuple[int, dict[str, Stored]]]:
        thread = threading.Thread(target=self._reader, name="layertap-readahead", daemon=True)
        thread.start()
        try:
            for _ in self.layers:
                started = time.perf_counter()
                item = self._ready.get()
                self.stats.wait_seconds += time.perf_counter() - started
                if isinstance(item, BaseException):
                    raise item
                yield item
                del item
                self._slots.release()
        finally:
            self._stop.set()
            self._slots.release()
            thread.join()
