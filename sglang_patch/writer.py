"""Getting captured rows off the device and onto disk without stalling SGLang's forward pass.

On a GPU, rows are copied with ``non_blocking=True`` into pinned host buffers and a CUDA event is
recorded after the copies; the writer thread waits on that event, never the forward stream. On the
CPU the copies are plain and there is no event. The writer thread takes dumps from a bounded queue:
when it falls behind, `DumpWriter.submit` blocks the forward pass (backpressure), which bounds the
host memory held by finished-but-unwritten dumps.

Each dump is written to a temp folder, every file and the folder are fsynced, then the folder is
renamed to ``<dump_root>/<quote(rid)>/`` and the root is fsynced (the rename is the commit point).
The tensors file is laid out as the server's dump layout says (`sglang_patch.contract`): all
captured states, or the sample already in a trainer's format (`sglang_patch.sample_files`).
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from sglang_patch.contract import (
    AUX,
    FINAL_TENSORS,
    INPUT_IDS,
    LOSS_MASK_PARAM,
    META_FILE,
    SPECFORGE,
    SPECULATORS,
    DumpMeta,
    dump_dir,
    temp_dir,
)
from sglang_patch.sample_files import (
    ids_sha256,
    mask_from_runs,
    specforge_tensors,
    speculators_tensors,
    write_sample,
)

logger = logging.getLogger(__name__)


class HostStaging:
    """Host buffers and completion events for rows captured on `device`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned = device.type == "cuda"

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor, pinned when the rows come from a GPU (async D2H needs it)."""
        return torch.empty(shape, dtype=dtype, pin_memory=self._pinned)

    def record(self) -> torch.cuda.Event | None:
        """An event after the copies issued so far on the current stream; None on the CPU."""
        if not self._pinned:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event


@dataclass(frozen=True, slots=True)
class DumpJob:
    """One dump to write: `tensors` (host, named as in the contract) for a capture, or an `error`.

    `loss_mask_runs` is what the client sent as the sample's loss mask (unchecked; specforge needs it).
    """

    rid: str
    tensors: dict[str, torch.Tensor] | None = None
    error: str | None = None
    ready: torch.cuda.Event | None = None
    loss_mask_runs: object = None


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
) -> DumpMeta:
    """The ``meta.json`` of a dump; `tensors` must already be valid (their event waited on)."""
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
        )
    aux = tensors[AUX]
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
    )


def layout_tensors(layout: str, tensors: dict[str, torch.Tensor], loss_mask: torch.Tensor | None) -> dict:
    """The tensors of a dump's file in `layout`, from the captured ones (named as in the contract)."""
    ids, aux = tensors[INPUT_IDS], tensors[AUX]
    if layout == SPECFORGE:
        if loss_mask is None:
            raise ValueError("a specforge dump needs the sample's loss mask")
        return specforge_tensors(ids, loss_mask, aux, tensors[FINAL_TENSORS["post"]])
    if layout == SPECULATORS:
        return speculators_tensors(ids, aux, tensors[FINAL_TENSORS["pre"]])
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
            _write_tensors(tmp / meta.file, meta.layout, layout_tensors(meta.layout, tensors, loss_mask))
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


def _write_tensors(path: Path, layout: str, tensors: dict[str, torch.Tensor]) -> None:
    if layout in (SPECFORGE, SPECULATORS):
        with path.open("wb") as f:
            write_sample(layout, tensors, f)
    else:
        save_file(tensors, path)
    fsync_path(path)


class DumpWriter:
    """A background thread that writes `DumpJob`s from a bounded queue (see module docstring)."""

    def __init__(
        self,
        dump_root: Path,
        *,
        layers: tuple[int, ...],
        finals: tuple[str, ...],
        max_pending: int,
        layout: str = "states",
    ) -> None:
        self.dump_root = Path(dump_root)
        self.dump_root.mkdir(parents=True, exist_ok=True)
        self._layers = layers
        self._finals = finals
        self._layout = layout
        self._queue: queue.Queue[DumpJob | None] = queue.Queue(maxsize=max_pending)
        self._tags = itertools.count()
        self._thread = threading.Thread(target=self._run, name="layertap-dump-writer", daemon=True)
        self._thread.start()

    def submit(self, job: DumpJob) -> None:
        """Queue a dump; blocks while `max_pending` dumps wait (the forward pass slows to the disk)."""
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            started = time.monotonic()
            self._queue.put(job)
            logger.warning(
                "dump writer lagging: forward pass waited %.3f s to queue %s", time.monotonic() - started, job.rid
            )

    def close(self, timeout: float | None = None) -> None:
        """Write what is queued, then stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                self._write(job)
            except Exception:
                logger.exception("failed to write the dump of %s", job.rid)

    def _write(self, job: DumpJob) -> None:
        started = time.monotonic()
        if job.ready is not None:
            job.ready.synchronize()
        tensors, error, loss_mask = job.tensors, job.error, None
        if tensors is not None and self._layout == SPECFORGE:
            try:
                loss_mask = self._loss_mask(job.loss_mask_runs, int(tensors[INPUT_IDS].shape[0]))
            except ValueError as exc:
                tensors, error = None, str(exc)
        meta = build_meta(job.rid, tensors, error, layers=self._layers, finals=self._finals, layout=self._layout)
        tag = f"{os.getpid()}-{next(self._tags)}"
        path = write_dump(self.dump_root, meta, tensors, tag=tag, loss_mask=loss_mask)
        logger.info(
            "dump %s: %s, %d tokens, %.3f s", path.name, meta.status, meta.num_tokens, time.monotonic() - started
        )

    @staticmethod
    def _loss_mask(runs: object, length: int) -> torch.Tensor:
        if runs is None:
            raise ValueError(
                "this server writes specforge dumps, which hold the loss mask, and the request carried none: "
                f"send sampling_params.custom_params.{LOSS_MASK_PARAM} as [start, end) runs"
            )
        return mask_from_runs(runs, length, torch.long)
