"""The producer of a stream: each committed sample put into Mooncake Store and its manifest XADDed to Redis.

`MooncakeSink` is what a run's stream target (`layertap.pipeline.targets`) puts through: the run opens it once its
store exists, and each commit thread hands it a sample's tensors as captured (no file is read back: a stream-only run
writes none). The commit threads put side by side, off the capture thread, so the capture waits on Mooncake only
while every commit thread is busy; a commit returns once its sample is put (its tensors may be views of the server's
dump), and the run is held only while ``max_unacked`` samples wait for their acks (its memory flat; the stream's
``held`` hash says so: the views' ``held``). The bound and the acks are kept under one lock; the copies into the
segment run outside it, so the puts of several commit threads overlap. The objects live in this process's segment, so
`drain` keeps it alive until every sample put is acked.

A job's shard attempt is a producer of its own (``worker.runner``): it opens the sink on its rows, waits for its
acks (`wait_acked`) before the shard counts done, and the job's finalizer ends the stream (`end_stream`). The worker
keeps the sink's Mooncake client from one attempt to the next (`KeptClients`) while nothing an attempt put is left in
its segment.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, packed_layout
from redis import Redis
from redis.exceptions import RedisError

from layertap.settings import RunSettings
from layertap.state.keys import Keys
from layertap.state.model import StreamView
from layertap.state.views import settled_samples
from layertap.store.index import SampleRecord
from layertap.store.store import OutputStore
from layertap.stream.mooncake import (
    StreamError,
    connect,
    disconnect,
    fingerprint,
    objects_present,
    put_packed,
    run_identity,
    sample_manifest,
    segment_file,
    settled,
)
from sglang_patch.contract import Placement

log = logging.getLogger(__name__)
LOST_CHECK_S = 1.0  # how often a waiting producer checks that its unacked objects are still there
ACK_POLL_S = 0.1  # how often a put collects the acks when the bound is not reached (a Redis round trip each)
RERUN = "Run the same command again to resume: it puts again every sample no consumer acked."


def stream_name(settings: RunSettings, out: Path) -> str:
    """A run's stream: ``stream_name``, else its output folder's name (a job's: its id, unless it named ``out``)."""
    return settings.stream_name or out.name


def open_sink(settings: RunSettings, out: Path, **options: Any) -> MooncakeSink:
    """The sink of a run into ``out`` (`MooncakeSink`, ``options`` its own), connected before any work: a master or
    Redis it cannot reach is refused first."""
    return MooncakeSink(settings.stream_redis_url, stream_name(settings, out), master=settings.mooncake_master,
                        segment_bytes=settings.mooncake_segment_mib << 20, max_unacked=settings.stream_unacked,
                        **options)  # fmt: skip


class KeptClients:
    """A worker's producers' Mooncake clients, one per master, segment size and segment folder, kept from one shard attempt to the
    next. Mooncake's close holds the GIL ~2 s (every thread of the worker stops) and a new segment is faulted in
    again: at each attempt, about what a GPU shard of 100 samples takes to capture. An attempt's sink borrows the
    client (`open`) and gives it back (`give_back`): kept when all it put was settled (`MooncakeSink.detach`),
    otherwise unmounted as before, so what an attempt leaves unacked still goes with its segment."""

    def __init__(self) -> None:
        self.kept: dict[tuple[str, int, Path | None], MooncakeHiddenStatesStore] = {}

    def open(self, settings: RunSettings, out: Path, **options: Any) -> MooncakeSink:
        """`open_sink` through the client kept for ``settings``' master and segment, if any."""
        store = self.kept.pop((settings.mooncake_master, settings.mooncake_segment_mib << 20,
                               options.get("segment_dir")), None)  # fmt: skip
        try:
            return open_sink(settings, out, store=store, **options)
        except BaseException:  # Redis refused: the client is not left mounted with no one to close it
            if store is not None:
                disconnect(store)
            raise

    def give_back(self, sink: MooncakeSink) -> None:
        if (store := sink.detach()) is not None:
            self.kept[(sink.master, sink.segment_bytes, sink.segment_dir)] = store

    def close(self) -> None:
        """Unmount every kept client's segment (a worker leaving, or taking a shard that does not stream)."""
        while self.kept:
            disconnect(self.kept.popitem()[1])


def end_stream(redis: Redis, keys: Keys, name: str) -> None:
    """Tell the stream's consumers that its run put its last sample (they end once every sample put is acked)."""
    redis.hset(keys.stream_run(name), "ended", 1)


def redis_client(url: str) -> Redis:
    """A client of ``url``, refused in one line when it does not answer."""
    client = Redis.from_url(url, socket_connect_timeout=3)
    try:
        client.ping()
    except RedisError as exc:
        raise StreamError(f"no Redis at {url} for the stream's manifests ({exc})") from None
    return client


class Staged(NamedTuple):
    """A sample's record as streamed and the manifest its put announces (`MooncakeSink.staged`)."""

    record: SampleRecord
    manifest: dict[str, Any]


class MooncakeSink:
    """Puts a run's committed samples into Mooncake Store (hard-pinned, in hs-connectors' packed layout) and their
    manifests on the Redis stream ``{prefix}:stream:{name}``; at most ``max_unacked`` of them unacked at once.
    ``keep_going`` is asked every second while it waits for acks: once False (a job's shard cancelled or taken
    away) the wait stops, and a sample then not put is left to the attempt that resumes the shard. ``on_acked`` is
    told each record whose ack it collects (a stream-only run's store mirrors them: `OutputStore.log_acked`)."""

    def __init__(
        self,
        redis_url: str,
        name: str,
        *,
        master: str,
        segment_bytes: int,
        max_unacked: int,
        prefix: str = "layertap",
        poll_s: float = 0.02,
        keep_going: Callable[[], bool] = lambda: True,
        on_acked: Callable[[SampleRecord], None] = lambda record: None,
        store: MooncakeHiddenStatesStore | None = None,
        segment_dir: Path | None = None,
    ) -> None:
        self.store = store or connect(master, segment_bytes=segment_bytes, pin=True, segment_dir=segment_dir)
        # The segment's file, where a capture server may write samples itself (`place`); None: anonymous memory.
        self.segment_dir, self.segment_file = segment_dir, segment_file(self.store)
        # sample id -> its object reserved (`place`), not yet announced, and the seconds its reservation took
        self.placed: dict[str, tuple[Placement, float]] = {}
        self.fenced = 0  # objects reserved for captures that failed for good, left in the segment (`cancel`)
        self.redis = redis_client(redis_url)
        self.keys, self.name, self.master, self.segment_bytes = Keys(prefix), name, master, segment_bytes
        self.max_unacked, self.poll_s, self.keep_going, self.on_acked = max_unacked, poll_s, keep_going, on_acked
        self.nonce = uuid.uuid4().hex[:12]  # this producer's handles: a resumed run never meets a dead one's key
        self.unacked: dict[str, tuple[str, SampleRecord]] = {}  # sample id -> (handle, record), put and not acked
        self.putting = 0  # puts under way (counted in the bound; their objects not yet there)
        self.collected = 0.0  # time.monotonic() when the acks were last collected
        self.lock = threading.Lock()  # ``unacked``, ``putting`` and the counts: the commit threads put side by side
        self.turn = threading.Lock()  # one commit thread at a time checks the bound (and waits at it)
        self.put_count = 0
        self.dead = 0  # samples put that a consumer dead-lettered (this run's, or an earlier run's: `put`)
        self.dead_letters: set[str] = set()  # the stream's dead-lettered samples when this run opened it
        self.held_since: float | None = None  # time.time() when the wait at the bound began; None while it puts
        self.held_s = 0.0  # this run's waits at the bound, ended ones summed
        self.ended = False
        self.broken: StreamError | None = None  # once a put failed or objects were lost: every later put refused
        self.missing: set[str] = set()  # unacked samples whose objects the last check did not find
        self.run = ""

    def open(self, store: OutputStore, server: str | None) -> None:
        """Before the run's first sample: its identity (`run_identity`) and its store's sample layout published for
        consumers."""
        identity = run_identity(store.manifest, server)
        self.run = fingerprint(identity)
        run = {"identity": json.dumps(identity), "fingerprint": self.run, "layout": json.dumps(asdict(store.layout)),
               "ended": 0, "bound": self.max_unacked}  # fmt: skip
        with self.redis.pipeline() as pipe:
            pipe.hset(self.keys.stream_run(self.name), mapping=run)
            pipe.zadd(self.keys.streams, {self.name: round(time.time() * 1000)})
            pipe.hkeys(self.keys.stream_dead(self.name))
            *_, dead = pipe.execute()
        self.dead_letters = {sample_id.decode() for sample_id in dead}

    def acked(self) -> set[str]:
        """The ids of the samples consumers acked on this stream (a resumed run's done, whoever put them)."""
        return {k.decode() for k in self.redis.hkeys(self.keys.stream_acked(self.name))}

    def put_before(self) -> set[str]:
        """The ids of the samples any producer of this stream put (acked or not)."""
        return {k.decode() for k in self.redis.hkeys(self.keys.stream_current(self.name))}

    def staged(self, record: SampleRecord, tensors: dict[str, torch.Tensor]) -> Staged:
        """``record`` as this sink streams it (its ``file`` the object's handle, ``nbytes`` its packed size) with the
        manifest its put announces: built once, before a stream-only run logs the record (`put` takes both)."""
        manifest = sample_manifest(self.handle(record.index), tensors, record, self.run)
        return Staged(replace(record, file=manifest["handle"], nbytes=manifest["metadata"]["total_aligned_bytes"]),
                      manifest)  # fmt: skip

    def handle(self, index: int) -> str:
        """The object key of row ``index``'s sample, put or placed by this producer."""
        return f"lt-{self.nonce}-{index}"

    def put(self, staged: Staged, tensors: dict[str, torch.Tensor]) -> None:
        """One committed sample (``staged`` from its ``tensors``: speculators' sample and its ``loss_mask``), put and
        announced; returns once it is put (the tensors may be views of a dump the engine frees next). Waits while
        ``max_unacked`` samples wait for their acks (not put once ``keep_going`` turns False: the shard's next attempt
        puts it).
        Called by the commit threads side by side: they take turns only to check the bound (and wait at it). A sample
        the stream dead-lettered before (a resumed run's) is counted put and dead, not put again: the dead-letter list
        settles it for every group, so no consumer would read it or remove its object."""
        record, manifest = staged
        if record.sample_id in self.dead_letters:
            with self.lock:
                self.put_count, self.dead = self.put_count + 1, self.dead + 1
            return
        if not self._enter():
            return
        t0 = time.perf_counter()
        announced = False
        try:
            try:
                put_packed(self.store, manifest, tensors)
            except RuntimeError as exc:  # Mooncake's status codes: the master down (-900), the segment full...
                raise self._failed(f"putting sample {record.sample_id}", exc) from exc
            self._announce(record, manifest, t0)
            announced = True
        finally:  # a put that failed (the run then stops) leaves the bound as it found it
            self._leave(record if announced else None, manifest["handle"])

    def place(
        self, sample_id: str, index: int, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
    ) -> Placement | None:
        """Reserve the object of row ``index``'s sample (its tensors' ``shapes``, packed as `sample_manifest` packs
        them) in this producer's segment file, for its capture server to write into (`layertap.engines.base.Placer`):
        a put under way in the bound from now (waiting there as `put` does). Each attempt of the sample gets the same
        one, until it is announced (`announce`) or given back (`cancel`). None where the segment is no file, the sample
        was dead-lettered before (`put` counts it) or the run stops."""
        if self.segment_file is None or sample_id in self.dead_letters:
            return None
        with self.lock:
            if sample_id in self.placed:
                return self.placed[sample_id][0]
        if not self._enter():
            return None
        key, t0 = self.handle(index), time.perf_counter()
        specs, size = packed_layout(dict(sorted(shapes.items())))
        try:
            offset = self.store._store.reserve(key, size)
        except RuntimeError as exc:
            self._leave(None, key)
            raise self._failed(f"reserving sample {sample_id}", exc) from exc
        place = Placement(key, str(self.segment_file), offset, size, _spans(specs))
        with self.lock:
            self.placed[sample_id] = (place, time.perf_counter() - t0)
        return place

    def announce(self, staged: Staged) -> None:
        """A placed sample (`place`) its capture server wrote, announced as `put` announces a sample it copied (its
        manifest must pack the tensors where they were placed)."""
        record, manifest = staged
        with self.lock:
            place, reserving = self.placed.pop(record.sample_id)
        announced = False
        try:
            if manifest["handle"] != place.key or _spans(manifest["tensors"]) != place.tensors:
                raise StreamError(f"sample {record.sample_id} is packed otherwise than it was placed ({place.tensors})")
            self._announce(record, manifest, time.perf_counter() - reserving, placed=True)  # the reservation, the XADD
            announced = True
        finally:
            self._leave(record if announced else None, place.key)

    def cancel(self, sample_id: str | None = None, *, fenced: bool = False) -> None:
        """Give back the place in the bound of ``sample_id``'s reservation (with None: of every one left) and its
        object: now for a capture that came back unplaced (a server that wrote a dump of its own). ``fenced``: its
        server may yet write into the object (a capture that failed for good: a request aborted, a dump later than the
        engine's wait), so the object stays, never announced, until the segment goes, and no later sample is put where
        that write would land; the client is then not kept for a later producer (`detach`)."""
        with self.lock:
            ids = list(self.placed) if sample_id is None else [sample_id]
            places = [self.placed.pop(i)[0] for i in ids if i in self.placed]
            self.fenced += len(places) if fenced else 0
        for place in places:
            if not fenced:
                self.store._store.remove(place.key, True)  # hard-pinned: removed only when forced
                settled(self.store, [place.key])
            self._leave(None, place.key)

    def _enter(self) -> bool:
        """One more put under way in the bound, after waiting there while ``max_unacked`` samples wait for their acks;
        False (none) once ``keep_going`` turns False meanwhile. The commit threads take turns here only."""
        with self.turn:
            if self.broken is not None:
                raise self.broken
            if time.monotonic() - self.collected > ACK_POLL_S or self._in_flight() >= self.max_unacked:
                self._collect_acks()
            if self._in_flight() >= self.max_unacked and not self._hold():
                return False
            with self.lock:
                self.putting += 1
        return True

    def _leave(self, record: SampleRecord | None, handle: str) -> None:
        """A put under way ends: announced (``record``, whose object is ``handle``: it waits for its ack now) or not."""
        with self.lock:
            self.putting -= 1
            if record is not None:
                self.unacked[record.sample_id] = (handle, record)
                self.put_count += 1

    def _failed(self, what: str, exc: RuntimeError) -> StreamError:
        """The stream broken by a Mooncake call that failed: every later put is refused."""
        self.broken = StreamError(
            f"{what} into Mooncake Store failed ({exc}): is the master at {self.master} up, and does "
            f"--mooncake-segment-mib hold --stream-unacked samples? {RERUN}"
        )
        return self.broken

    def _announce(self, record: SampleRecord, manifest: dict[str, Any], t0: float, *, placed: bool = False) -> None:
        """The sample's entry XADDed with the stream's counts (one MULTI: ``put``, ``put_s``, and ``placed`` for a
        sample its server wrote into its object), its object in place."""
        with self.redis.pipeline() as pipe:  # MULTI: the entry with what consumers end on and drop stale entries by
            pipe.hset(self.keys.stream_current(self.name), record.sample_id, manifest["handle"])
            pipe.xadd(self.keys.stream(self.name), {"sample_id": record.sample_id, "manifest": json.dumps(manifest)})
            pipe.hincrby(self.keys.stream_run(self.name), "put", 1)
            pipe.hincrbyfloat(self.keys.stream_run(self.name), "put_s", time.perf_counter() - t0)  # where time goes
            pipe.hincrby(self.keys.stream_run(self.name), "placed", int(placed))
            pipe.execute()

    def drain(self) -> None:
        """After the run's last sample: say so to the consumers, then wait until every sample put is acked (the
        objects live in this process's segment). Ctrl-C (or a signal) stops the wait; what is unacked is lost."""
        end_stream(self.redis, self.keys, self.name)
        self.ended = True
        self.wait_acked()

    def wait_acked(self) -> bool:
        """Until every sample put is acked (True), or ``keep_going`` turns False (False: what is unacked goes with
        this process's segment, and a resumed run puts it again)."""
        if self.unacked:
            log.info("stream %s: waiting for %d unacked samples of %d put", self.name, len(self.unacked),
                     self.put_count)  # fmt: skip
        with self.turn:
            return self._wait(lambda: self._in_flight() == 0)

    def close(self) -> None:
        """Unmount the segment (its objects go with it) and drop the Redis client."""
        if (store := self.detach()) is not None:
            disconnect(store)

    def detach(self) -> MooncakeHiddenStatesStore | None:
        """Drop the Redis client and give up the Mooncake client: returned when every sample put through this sink
        was settled and none fenced (its segment holds none of them, so a later producer may put through it), else
        unmounted (its objects go with it: a resumed run puts them again) and None."""
        self.redis.close()
        with self.lock:
            clean = self.broken is None and not self.unacked and not self.putting and not self.fenced
        if clean:
            return self.store
        disconnect(self.store)
        return None

    def view(self) -> StreamView:
        """This run's puts against its consumers, from what the producer knows (no round trip: the CLI's bar draws it
        several times a second); the acks as last collected."""
        held_now = 0.0 if self.held_since is None else time.time() - self.held_since
        return StreamView(self.name, put=self.put_count, acked=self.put_count - len(self.unacked) - self.dead,
                          bound=self.max_unacked, held=int(self.held_since is not None), held_s=self.held_s + held_now,
                          ended=self.ended, dead=self.dead)  # fmt: skip

    def _hold(self) -> bool:
        """Wait at the bound until a consumer acks, the wait told for the views (`layertap.state.views.stream_views`):
        in the stream's ``held`` hash while it lasts (said again every second, so a killed producer's word goes
        stale), then added to the run's ``held_s``."""
        self.held_since = time.time()
        self._say_held()
        try:
            return self._wait(lambda: self._in_flight() < self.max_unacked)
        finally:
            held, self.held_since = time.time() - self.held_since, None
            self.held_s += held
            with self.redis.pipeline() as pipe:
                pipe.hdel(self.keys.stream_held(self.name), self.nonce)
                pipe.hincrbyfloat(self.keys.stream_run(self.name), "held_s", held)
                pipe.execute()

    def _say_held(self) -> None:
        assert self.held_since is not None
        since, now = round(self.held_since * 1000), round(time.time() * 1000)
        self.redis.hset(self.keys.stream_held(self.name), self.nonce, f"{since} {now}")

    def _wait(self, done: Callable[[], bool]) -> bool:
        """Poll the acks until ``done()`` (True); every second, check that what waits for its ack is still there and
        that the run goes on (False once ``keep_going`` says not)."""
        checked = time.monotonic()
        while True:
            self._collect_acks()
            if done():
                return True
            if time.monotonic() - checked > LOST_CHECK_S:
                self._check_not_lost()
                if self.held_since is not None:
                    self._say_held()
                if not self.keep_going():
                    return False
                checked = time.monotonic()
            time.sleep(self.poll_s)

    def _check_not_lost(self) -> None:
        """StreamError when objects put and not acked are gone (a restarted master forgets every object): no
        consumer can read them, so waiting would never end. A consumer records its ack before it removes the
        object, so the acks are collected again before one missing counts; and it counts lost only when it was
        missing at the check before too (a check apart), so an object being replaced (removed, then put again) is
        not taken for one a restarted master forgot."""
        with self.lock:
            waiting = list(self.unacked.items())
        present = objects_present(self.store, [handle for _, (handle, _) in waiting])
        if all(present):
            self.missing = set()
            return
        self._collect_acks()
        gone = {i for (i, _), found in zip(waiting, present, strict=True) if not found and i in self.unacked}
        lost, self.missing = sorted(gone & self.missing), gone
        if lost:
            self.broken = StreamError(
                f"{len(lost)} samples put and not acked are gone from Mooncake Store (e.g. {lost[0]}): was the "
                f"master at {self.master} restarted? {RERUN}"
            )
            raise self.broken

    def _in_flight(self) -> int:
        """Samples put or being put, not yet acked: what the bound counts."""
        with self.lock:
            return len(self.unacked) + self.putting

    def _collect_acks(self) -> None:
        """The acks and dead letters of the samples put, collected (by the thread whose turn it is)."""
        self.collected = time.monotonic()
        with self.lock:
            ids = list(self.unacked)
        if not ids:
            return
        acked, dead = settled_samples(self.redis, self.keys, self.name, ids)
        with self.lock:
            delivered = [self.unacked.pop(sample_id) for sample_id in acked]
            # a dead-lettered sample is settled, counted dead, not delivered
            handles = [handle for handle, _ in delivered] + [self.unacked.pop(sample_id)[0] for sample_id in dead]
            self.dead += len(dead)
        settled(self.store, handles)
        for _, record in delivered:
            self.on_acked(record)


def _spans(specs: dict[str, dict[str, Any]]) -> dict[str, tuple[int, int]]:
    """name -> (offset, nbytes) of a packed layout's tensors (hs-connectors' ``packed_layout`` specs)."""
    return {name: (spec["offset"], spec["nbytes"]) for name, spec in specs.items()}
