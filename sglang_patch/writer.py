"""Getting captured rows off the device and onto disk without stalling SGLang's forward pass.

On a GPU, rows are copied with ``non_blocking=True`` into pinned host buffers on a side stream
(`HostStaging`) and a CUDA event is recorded after the copies; a writer thread waits on that event,
never the forward stream. On the CPU the copies are plain and there is no event.

Host memory is bounded in bytes (`HostBudget`): a request's buffers are reserved when its first
rows arrive and given back once its dump is written. The forward pass waits only when a new
request would pass the cap while written dumps are still to come back, i.e. when the writers (the
disk) are slower than prefill. Several writer threads (`DumpWriter`) take dumps from one queue.

The writers share the scheduler's GIL, whose loop rarely lets go of it: each time a writer needs it
back it may wait a switch interval (5 ms), and each time it takes it the scheduler waits. So a dump
is written in a handful of calls that run without the GIL (torch.save to a path: C++ writes every
record; safetensors: one write per tensor), and nothing is hashed here: the worker hashes the file
once as it commits it, in its own process (benchmarks/results/writer_commit.md, table 4).

Each dump is written to a temp folder, every file and the folder are fsynced, then the folder is
renamed to ``<dump_root>/<quote(rid)>/`` and the root is fsynced (the rename is the commit point).
The tensors file is laid out as the server's dump layout says (`sglang_patch.contract`): all
captured states, or the sample already in a trainer's format (`sglang_patch.sample_files`). A request that
carries a placement has its speculators sample written there instead (`sglang_patch.segments`: into a stream
producer's Mooncake segment, the bytes its trainers read), and its dump folder holds only meta.json, or its tensors
file too when the placement asks for it (a run that streams its samples and keeps their files).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from sglang_patch.contract import (
    AUX,
    AUX_FINAL_PRE,
    FINAL_TENSORS,
    INPUT_IDS,
    LOSS_MASK_PARAM,
    META_FILE,
    PLACE_PARAM,
    PLACED_MASK,
    SCALES,
    SEGMENT_PREFIX,
    SPECFORGE,
    SPECULATORS,
    DumpMeta,
    Placement,
    dump_dir,
    temp_dir,
)
from sglang_patch.sample_files import (
    ids_sha256,
    mask_from_runs,
    specforge_tensors,
    speculators_tensors,
    write_safetensors,
)
from sglang_patch.segments import Segments

logger = logging.getLogger(__name__)
SWEEP_S = 5.0  # an idle writer unmaps, this often, the segment files their producers removed


class HostBudget:
    """Bytes of host memory held by captured rows, under a cap (thread-safe).

    `reserve` (the forward pass) blocks while the cap would be passed and dumps handed to the writers
    are still to give their bytes back; with nothing handed over it goes through (the bytes are then
    held by requests still being prefilled, which only forward passes can finish: waiting would
    deadlock), so the cap is passed by at most the requests in mid-prefill (one per scheduler with
    chunked prefill). `peak` is the most ever held; `waited_s` the forward pass's total wait.
    """

    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = cap_bytes
        self.in_use = 0
        self.peak = 0
        self.waited_s = 0.0
        self._handed = 0  # bytes of dumps queued or being written
        self._unreported_wait = 0.0
        self._cond = threading.Condition()

    def reserve(self, nbytes: int) -> float:
        """Take `nbytes`, waiting as the class says; returns the seconds waited."""
        with self._cond:
            waited, started = 0.0, time.monotonic()
            while self.in_use + nbytes > self.cap_bytes and self._handed > 0:
                self._cond.wait()
                waited = time.monotonic() - started
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)
            self.waited_s += waited
            self._unreported_wait += waited
            return waited

    def hand_over(self, nbytes: int) -> float:
        """`nbytes` now belong to a dump queued for the writers; returns the wait not yet reported
        (each second waited is reported with exactly one dump)."""
        with self._cond:
            self._handed += nbytes
            wait, self._unreported_wait = self._unreported_wait, 0.0
            return wait

    def release(self, nbytes: int, *, handed: bool) -> None:
        with self._cond:
            self.in_use -= nbytes
            if handed:
                self._handed -= nbytes
            self._cond.notify_all()


class HostStaging:
    """Host buffers, the copy stream and completion events for rows captured on `device`.

    On a GPU the device-to-host copies run on a side stream that first waits for the pass's rows:
    on the forward stream they would hold up the next pass (~5 ms per 4096-token pass at Llama-8B
    width), on their own stream they overlap it. Rows handed to `copying` must be tensors the
    forward pass will not write again (the hook's own sums, stacks and clones).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._stream: torch.cuda.Stream | None = None  # made at the first copy (CPU tests build this class)

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor, pinned when the rows come from a GPU (async D2H needs it)."""
        return torch.empty(shape, dtype=dtype, pin_memory=self._pinned)

    def footprint(self, nbytes: int) -> int:
        """Host memory a buffer of `nbytes` takes: torch's pinned allocator rounds up to a power of 2."""
        return 1 << (nbytes - 1).bit_length() if self._pinned and nbytes > 1 else nbytes

    @contextlib.contextmanager
    def copying(self, rows: Iterable[torch.Tensor]) -> Iterator[None]:
        """Issue the copies made inside on the copy stream, after the work that produced `rows`; their
        memory is not reused before those copies are done. A no-op on the CPU."""
        if not self._pinned:
            yield
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        for t in rows:
            t.record_stream(self._stream)
        with torch.cuda.stream(self._stream):
            yield

    def record(self) -> torch.cuda.Event | None:
        """An event after the copies issued so far (on the copy stream); None on the CPU."""
        if not self._pinned:
            return None
        event = torch.cuda.Event()
        event.record(self._stream or torch.cuda.current_stream(self.device))
        return event


def pinned_allocator_stats() -> dict[str, float]:
    """torch's pinned allocator, process-wide: bytes it holds (in use + cached: freed blocks are kept
    for reuse, beyond `HostBudget`'s count) and seconds spent growing it (cudaHostAlloc, which runs on
    the forward pass's thread in `HostStaging.alloc`). Read by the writers, off the forward pass."""
    stats = torch.cuda.host_memory_stats()
    held = stats.get("reserved_bytes.current", stats.get("allocated_bytes.current", 0))
    return {"pinned_held_bytes": held, "pinned_alloc_s": stats.get("host_alloc_time.total", 0) / 1e6}  # µs


@dataclass(frozen=True, slots=True)
class DumpJob:
    """One dump to write: `tensors` (host, named as in the contract) for a capture, or an `error`.

    `params`: the custom params the client sent (unchecked): the sample's loss mask (specforge and a placement need
    it), its placement (`contract.Placement`).
    `nbytes`: host memory reserved for `tensors` in the writer's `HostBudget`, given back once written.
    """

    rid: str
    tensors: dict[str, torch.Tensor] | None = None
    error: str | None = None
    ready: torch.cuda.Event | None = None
    params: dict[str, object] = field(default_factory=dict)
    nbytes: int = 0


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a folder's entries (making a rename inside it durable), to disk.

    The layertap store uses this too: the plugin may not import the core, the core may import this.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def build_meta(
    rid: str,
    tensors: dict[str, torch.Tensor] | None,
    error: str | None,
    *,
    layers: tuple[int, ...],
    finals: tuple[str, ...],
    layout: str = "states",
    writer: dict[str, float] | None = None,
) -> DumpMeta:
    """The ``meta.json`` of a dump, without its file's sha256 (known once written); `tensors` must
    already be valid (their event waited on)."""
    if tensors is None:
        return DumpMeta(
            rid=rid,
            status="error",
            error=error,
            num_tokens=0,
            input_ids_sha256=None,
            layers=layers,
            finals=finals,
            dtype=None,
            hidden_size=None,
            layout=layout,
            writer=writer,
        )
    aux = tensors[AUX] if AUX in tensors else tensors[AUX_FINAL_PRE]
    return DumpMeta(
        rid=rid,
        status="ok",
        error=None,
        num_tokens=int(aux.shape[0]),
        input_ids_sha256=ids_sha256(tensors[INPUT_IDS]),
        layers=layers,
        finals=finals,
        dtype=str(aux.dtype).removeprefix("torch."),
        hidden_size=int(aux.shape[-1]),
        layout=layout,
        writer=writer,
    )


def layout_tensors(layout: str, tensors: dict[str, torch.Tensor], loss_mask: torch.Tensor | None) -> dict:
    """The tensors of a dump's file in `layout`, from the captured ones (named as in the contract)."""
    ids = tensors[INPUT_IDS]
    if layout == SPECFORGE:
        if loss_mask is None:
            raise ValueError("a specforge dump needs the sample's loss mask")
        return specforge_tensors(ids, loss_mask, tensors[AUX], tensors[FINAL_TENSORS["post"]])
    if layout == SPECULATORS:
        return speculators_tensors(ids, tensors[AUX_FINAL_PRE], tensors.get(SCALES))
    return tensors


def write_dump(
    dump_root: Path,
    meta: DumpMeta,
    tensors: dict[str, torch.Tensor] | None,
    *,
    tag: str,
    loss_mask: torch.Tensor | None = None,
) -> Path:
    """Write one dump folder atomically and durably, its tensors file in `meta.layout`; returns its
    final path.

    Refuses (FileExistsError) to replace an existing dump of the same rid: a retry must use a new
    attempt number, and the first dump stays what the client may already have read.
    """
    final = dump_dir(dump_root, meta.rid)
    if final.exists():
        raise FileExistsError(f"dump {final} already exists")
    tmp = temp_dir(dump_root, meta.rid, tag)
    tmp.mkdir(parents=True)
    try:
        if tensors is not None:
            started = time.monotonic()
            write_tensors_file(tmp / meta.file, meta.layout, layout_tensors(meta.layout, tensors, loss_mask))
            if meta.writer is not None:  # the writer's own time per dump, beside its wait for the copies
                spent = meta.writer.get("write_s", 0.0) + time.monotonic() - started  # a placement's write before
                meta = replace(meta, writer={**meta.writer, "write_s": round(spent, 6)})
        with (tmp / META_FILE).open("w") as f:
            f.write(meta.to_json())
            f.flush()
            os.fsync(f.fileno())
        fsync_path(tmp)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_path(Path(dump_root))
    return final


def write_tensors_file(path: Path, layout: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write and fsync the tensors file in calls that release the GIL (see the module docstring)."""
    if layout == SPECFORGE:
        torch.save(tensors, str(path))  # a path: torch's C++ writer, no Python callback per record
    else:
        with path.open("wb") as f:  # buffered: it loops over partial writes (a raw write stops at 2 GiB)
            write_safetensors(tensors, f)
    fsync_path(path)


class DumpWriter:
    """`threads` writer threads taking `DumpJob`s from one queue (see module docstring); the host
    memory of queued dumps is accounted in `budget` and given back as each is written."""

    def __init__(
        self,
        dump_root: Path,
        *,
        layers: tuple[int, ...],
        finals: tuple[str, ...],
        budget: HostBudget,
        threads: int,
        layout: str = "states",
    ) -> None:
        self.dump_root = Path(dump_root)
        self.dump_root.mkdir(parents=True, exist_ok=True)
        self.budget = budget
        self._layers = layers
        self._finals = finals
        self._layout = layout
        self._queue: queue.Queue[tuple[DumpJob, dict[str, float]] | None] = queue.Queue()
        self._tags = itertools.count()
        self._segments = Segments()
        self._threads = [
            threading.Thread(target=self._run, name=f"layertap-dump-writer-{i}", daemon=True) for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, job: DumpJob) -> None:
        """Queue a dump (never blocks: the forward pass waits, if at all, in `HostBudget.reserve`)."""
        wait = self.budget.hand_over(job.nbytes)
        stats = {
            "wait_s": round(wait, 6),
            "queued": self._queue.qsize() + 1,
            "pinned_bytes": self.budget.in_use,
            "pinned_cap_bytes": self.budget.cap_bytes,
            "threads": len(self._threads),
        }
        if wait > 0.001:
            logger.warning(
                "dump writers lagging: the forward pass waited %.3f s for host memory (%d of %d bytes held)",
                wait, self.budget.in_use, self.budget.cap_bytes,
            )  # fmt: skip
        self._queue.put((job, stats))

    def close(self, timeout: float | None = None) -> None:
        """Write what is queued, then stop the threads."""
        for _ in self._threads:
            self._queue.put(None)
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=SWEEP_S)
            except queue.Empty:
                self._segments.sweep()  # a producer gone while no sample came: its file's pages go now
                continue
            if item is None:
                return
            job, stats = item
            try:
                self._write(job, stats)
            except FileExistsError:
                logger.exception("failed to write the dump of %s", job.rid)  # the first dump stays
            except Exception as exc:
                logger.exception("failed to write the dump of %s", job.rid)
                self._write_failure(job.rid, exc, stats)
            finally:
                # Drop the buffers before giving their bytes back (the budget counts live memory).
                nbytes, item, job = job.nbytes, None, None
                self.budget.release(nbytes, handed=True)

    def _write_failure(self, rid: str, exc: Exception, stats: dict[str, float]) -> None:
        """An error dump saying why the capture's could not be written (a full disk, say), so that its
        client fails the sample now instead of at its wait's timeout; logged if even that fails."""
        try:
            self._write(
                DumpJob(rid, error=f"the server could not write this capture: {type(exc).__name__}: {exc}"), stats
            )
        except Exception:
            logger.exception("failed to write the error dump of %s", rid)

    def _write(self, job: DumpJob, stats: dict[str, float]) -> None:
        started = time.monotonic()
        if job.ready is not None:  # rows from a GPU
            job.ready.synchronize()
            stats = {**stats, **pinned_allocator_stats()}
        stats = {**stats, "ready_s": round(time.monotonic() - started, 6)}
        tensors, error, loss_mask, place = job.tensors, job.error, None, None
        try:
            if tensors is not None and self._layout == SPECFORGE:
                loss_mask = self._loss_mask(job.params.get(LOSS_MASK_PARAM), int(tensors[INPUT_IDS].shape[0]))
            elif tensors is not None and job.params.get(PLACE_PARAM) is not None and SCALES not in tensors:
                written = time.monotonic()
                place = self._place(job.params, tensors)
                stats = {**stats, "write_s": round(time.monotonic() - written, 6)}
        except ValueError as exc:  # DumpError too
            tensors, error = None, str(exc)
        meta = build_meta(
            job.rid, tensors, error, layers=self._layers, finals=self._finals, layout=self._layout, writer=stats
        )
        meta = replace(meta, placed=place and place.param())
        tag = f"{os.getpid()}-{next(self._tags)}"
        file = tensors if place is None or place.file else None
        path = write_dump(self.dump_root, meta, file, tag=tag, loss_mask=loss_mask)
        logger.info("dump %s: %s%s, %d tokens, %.3f s (%.3f s of it waiting for the copies off the device)", path.name,
                    meta.status, " (placed)" * bool(place), meta.num_tokens, time.monotonic() - started,
                    stats["ready_s"])  # fmt: skip

    def _place(self, params: dict[str, object], tensors: dict[str, torch.Tensor]) -> Placement:
        """Write a speculators sample where its client placed it (`Segments.write`); ValueError when this server writes
        no speculators dumps or the placement is not one it may write."""
        if self._layout != SPECULATORS:
            raise ValueError(f"this server writes {self._layout} dumps: a placement takes speculators samples")
        place = Placement.from_param(params[PLACE_PARAM])
        path = Path(place.path)
        if path.parent.resolve() != self.dump_root.resolve() or not path.name.startswith(SEGMENT_PREFIX):
            raise ValueError(f"a placement must name a {SEGMENT_PREFIX}* file in this server's dump root "
                             f"{self.dump_root}, not {place.path}")  # fmt: skip
        mask = self._loss_mask(params.get(LOSS_MASK_PARAM), int(tensors[INPUT_IDS].shape[0]), torch.uint8)
        self._segments.write(place, {**layout_tensors(SPECULATORS, tensors, None), PLACED_MASK: mask})
        return place

    @staticmethod
    def _loss_mask(runs: object, length: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
        if runs is None:
            raise ValueError(
                "this server writes dumps that hold the loss mask, and the request carried none: "
                f"send sampling_params.custom_params.{LOSS_MASK_PARAM} as [start, end) runs"
            )
        return mask_from_runs(runs, length, dtype)
