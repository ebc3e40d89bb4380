"""Where a run's committed samples go, its ``target`` (`layertap.settings.Target`): sample files, a stream, or both.

A target says what is already there (a resumed run skips it), commits one captured sample (in a commit thread) and
returns its record, and says when what it was given is delivered. The store (the run folder) always keeps the run's
own record: manifest, errors, regenerated rows, the ledger of what is done.

- files (`FilesTarget`): each sample a file in the store; done once its file and index record are in place.
- stream (`StreamTarget`, ``files=False``): no sample file is written. A sample goes from the capture into the
  producer's Mooncake segment: where the capture server can write it there itself (`StreamTarget.place`: a segment
  file in its dump root, speculators samples in the compute dtype), nothing is copied; else its dump's bytes (or the
  engine's tensors) are put. It is done once a consumer acks it, and its
  record then goes to the store's index (`OutputStore.log_acked`), so a resume trusts Redis's acks and the run
  folder alike. A sample put and not acked is recomputed on resume: its object went with its producer.
- both (`StreamTarget`, ``files=True``): committed as files, then put from the same tensors; done once its file is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import torch

from layertap.engines.base import Placer
from layertap.pipeline.ledger import RunReport
from layertap.sample import CapturedSample, TokenizedSample
from layertap.store.formats.base import CheckLevel
from layertap.store.index import SampleRecord
from layertap.store.store import OutputStore
from sglang_patch.contract import PLACED_MASK, SPECULATORS, placed_tensors

log = logging.getLogger(__name__)


class Target(Protocol):
    """Where committed samples go (see the module's docstring)."""

    def open(self, server: str | None, start: int, stop: int | None) -> None:
        """Before the first sample of rows ``[start, stop)``: ``server`` is the capture server's URL (None in
        process)."""
        ...

    def done(self, report: RunReport, level: CheckLevel, start: int, stop: int | None) -> dict[str, SampleRecord]:
        """Sample id -> record of the samples of rows ``[start, stop)`` already there (a file re-checked at
        ``level``; an acked sample), those that are not told to ``report``."""
        ...

    def commit(self, captured: CapturedSample) -> SampleRecord:
        """One captured sample, committed: its record (SampleError when its states are not the store's)."""
        ...

    def delivered(self, *, last: bool) -> bool:
        """After the rows: until what was committed is delivered (False: the run was told to stop first). ``last``:
        no more samples come on this target's stream (a whole run's end; a job's shard is one producer of many)."""
        ...

    def undelivered(self) -> int:
        """Samples committed that no consumer could use (a stream's dead letters, settled but not delivered)."""
        ...

    def view(self) -> object | None:
        """The stream's puts against its acks for a progress bar (`layertap.state.model.StreamView`); None without
        a stream."""
        ...

    def placer(self) -> Placer | None:
        """Where a capture server may write samples itself (`Engine.placer`), or None."""
        ...

    def forget(self, sample_id: str) -> None:
        """A sample that failed its every attempt: what the target held for it given back."""
        ...

    def close(self) -> None: ...


class StreamSink(Protocol):
    """What a stream target puts through (`layertap.stream.sink.MooncakeSink`, which the caller opens: the pipeline
    does not import the stream package)."""

    name: str
    dead: int
    dead_letters: set[str]
    on_acked: Callable[[SampleRecord], None]

    def open(self, store: OutputStore, server: str | None) -> None: ...

    def acked(self) -> set[str]: ...

    def put_before(self) -> set[str]: ...

    def staged(self, record: SampleRecord, tensors: dict[str, torch.Tensor]) -> tuple[SampleRecord, Any]: ...

    def put(self, staged: tuple[SampleRecord, Any], tensors: dict[str, torch.Tensor]) -> None: ...

    segment_file: Path | None

    def place(self, sample_id: str, index: int, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> Any: ...

    def announce(self, staged: tuple[SampleRecord, Any]) -> None: ...

    def cancel(self, sample_id: str | None = None, *, fenced: bool = False) -> None: ...

    def drain(self) -> None: ...

    def wait_acked(self) -> bool: ...

    def view(self) -> object: ...

    def close(self) -> None: ...


class FilesTarget:
    """Sample files in the store: a sample is done once its file and its index record are in place."""

    def __init__(self, store: OutputStore) -> None:
        self.store = store

    def open(self, server: str | None, start: int, stop: int | None) -> None:
        return None

    def done(self, report: RunReport, level: CheckLevel, start: int, stop: int | None) -> dict[str, SampleRecord]:
        """The committed samples whose files pass `OutputStore.check`; the rest are redone (``report.redone``)."""
        done = {}
        for rec in _within(self.store.records(), start, stop):
            if self.store.check(rec, level):
                report.redone.append(rec.sample_id)
            else:
                done[rec.sample_id] = rec
        return done

    def commit(self, captured: CapturedSample) -> SampleRecord:
        return self.store.commit(captured)

    def delivered(self, *, last: bool) -> bool:
        return True

    def undelivered(self) -> int:
        return 0

    def view(self) -> object | None:
        return None

    def placer(self) -> Placer | None:
        return None

    def forget(self, sample_id: str) -> None:
        return None

    def close(self) -> None:
        return None


class StreamTarget:
    """A stream (its ``sink``), and with ``files`` the store's sample files too (the both target)."""

    def __init__(self, store: OutputStore, sink: StreamSink, *, files: bool) -> None:
        self.store, self.sink = store, sink
        self.files = FilesTarget(store) if files else None
        if self.files is None:
            sink.on_acked = store.log_acked

    def open(self, server: str | None, start: int, stop: int | None) -> None:
        """The run's identity published; the both target then puts again each sample of its rows in the store no
        consumer acked (a killed producer's objects went with it)."""
        self.sink.open(self.store, server)
        if self.files is None:
            return
        acked, put = self.sink.acked(), self.sink.put_before()
        # What a dead producer put first (a consumer may hold its entry and wait for it), then what it never put.
        unacked = sorted((r for r in _within(self.store.records(), start, stop) if r.sample_id not in acked),
                         key=lambda r: (r.sample_id not in put, r.index))  # fmt: skip
        if unacked:
            log.info("stream %s: putting the %d samples in the store no consumer acked (%d dead-lettered: counted, not "
                     "put)", self.sink.name, len(unacked), len(self.sink.dead_letters & {r.sample_id for r in unacked}))  # fmt: skip
        for record in unacked:
            tensors = {**self.store.format.load(self.store.root / record.file), "loss_mask": record.loss_mask()}
            self.sink.put(self.sink.staged(record, tensors), tensors)

    def done(self, report: RunReport, level: CheckLevel, start: int, stop: int | None) -> dict[str, SampleRecord]:
        """The both target: its files'. Stream-only: the samples consumers acked, as Redis and the store's index
        say; one Redis has and the index lacks (its producer died before it saw the ack) is logged there now."""
        if self.files is not None:
            return self.files.done(report, level, start, stop)
        records = self.store.records()
        streamed = self.store.streamed()
        for sample_id in self.sink.acked() - records.keys():
            if (record := streamed.get(sample_id)) is not None:
                self.store.log_acked(record)
                records[sample_id] = record
        return {r.sample_id: r for r in _within(records, start, stop)}

    def commit(self, captured: CapturedSample) -> SampleRecord:
        """Commit ``captured`` (both: its file; stream-only: its record logged as put), then put it from the
        capture's tensors, or announce it where the server wrote it (`place`); returns once it is put."""
        tensors = {**self.store.format.tensors(captured, self.store.layout),
                   PLACED_MASK: captured.sample.loss_mask.to(torch.uint8)}  # fmt: skip
        if self.files is not None:
            record = self.files.commit(captured)
            staged = self.sink.staged(record, tensors)
        else:
            staged = self.sink.staged(self.store.record_for(captured), tensors)
            record = staged[0]
            self.store.log_streamed(captured.sample, record)
        if captured.placed is not None:
            self.sink.announce(staged)
        else:
            self.sink.cancel(captured.sample.sample_id)  # placed, and the server wrote a dump of its own
            self.sink.put(staged, tensors)
        return record

    def placer(self) -> Placer | None:
        """This target, where its capture server can write samples into the stream's objects itself: the sink's
        segment a file (in the server's dump root), speculators samples stored in the dtype the server computes in
        (an FP8 store's scales are made otherwise)."""
        manifest = self.store.manifest
        placeable = manifest.format == SPECULATORS and manifest.store_dtype == manifest.compute_dtype
        return self if placeable and self.sink.segment_file is not None else None

    def place(self, sample: TokenizedSample) -> dict[str, Any] | None:
        """The object reserved for ``sample`` in the producer's segment (`MooncakeSink.place`), as its request sends
        it; the same for each attempt. The both target asks for the dump's file too: committed by a rename, as the
        files target commits it, not written again here."""
        shapes = {name: (shape, getattr(torch, dtype))
                  for name, (dtype, shape) in placed_tensors(self.store.layout, sample.num_tokens).items()}  # fmt: skip
        place = self.sink.place(sample.sample_id, sample.index, shapes)
        return None if place is None else replace(place, file=self.files is not None).param()

    def forget(self, sample_id: str) -> None:
        self.sink.cancel(sample_id, fenced=True)  # its server may still write where it was placed

    def delivered(self, *, last: bool) -> bool:
        self.sink.cancel(fenced=True)  # reservations of samples never committed (a run told to stop)
        if last:
            self.sink.drain()
            return True
        return self.sink.wait_acked()

    def undelivered(self) -> int:
        return self.sink.dead

    def view(self) -> object | None:
        return self.sink.view()

    def close(self) -> None:
        self.sink.close()


def _within(records: dict[str, SampleRecord], start: int, stop: int | None) -> list[SampleRecord]:
    return [r for r in records.values() if r.index >= start and (stop is None or r.index < stop)]
