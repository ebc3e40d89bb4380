"""``layertap stream-verify``: one consumer of a run's stream that checks each sample as it arrives, as ``verify``
checks a file (`delivery_problems`: the run's fingerprint, keys, shapes, dtypes, the ``input_ids`` hash, the loss
mask, finiteness), and acks it, so that it can stand in for a trainer in a smoke run.

It reads in a consumer group of its own (``stream-verify``), so it gets every sample beside the trainers' group
without taking theirs: an object is removed once every group registered when it was put has acked it. A sample with
problems is dead-lettered (reported, and settled for its producer and every group, not delivered): a trainer that
held it would keep the run waiting forever. The samples other consumers dead-lettered are problems too.
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from typing import Any

from layertap.store.formats.base import CheckLevel
from layertap.stream.consumer import StreamConsumer, stream_record
from layertap.stream.mooncake import objects_present
from layertap.verify import VerifyReport

log = logging.getLogger(__name__)


def verify_stream(
    redis_url: str, name: str, *, level: CheckLevel = "full", idle_s: float | None = None, **consumer: Any
) -> VerifyReport:
    """Take the stream's samples as one consumer (``consumer``: `StreamConsumer`'s own arguments, ``master`` first)
    until the stream has ended for its group: each checked at ``level``, acked, or dead-lettered when its checks
    fail; each delivered once, each dataset row under one sample id; what other consumers dead-lettered reported.
    With ``idle_s``: give up once nothing arrived for that long, every sample put and not acked then a problem that
    says where it is (`_left`)."""
    reader = StreamConsumer(redis_url, name, **consumer)
    report = VerifyReport(what=f"stream {name}")
    if not reader.redis.exists(reader.keys.stream_run(name)):
        log.warning("stream %s has no run yet (prefix %s): waiting for its producer", name, reader.keys.prefix)
    rows: dict[int, set[str]] = defaultdict(set)
    delivered: set[str] = set()
    try:
        idle_since = time.monotonic()
        while not reader.finished():
            if (delivery := reader.poll(level)) is None:
                if idle_s is not None and time.monotonic() - idle_since > idle_s:
                    report.problems += _left(reader, idle_s)
                    break
                continue
            idle_since = time.monotonic()
            record = stream_record(delivery.manifest)
            report.samples, report.tokens, report.nbytes = (report.samples + 1, report.tokens + record.num_tokens,
                                                            report.nbytes + record.nbytes)  # fmt: skip
            where = f"sample {delivery.sample_id} (row {record.index})"
            report.problems += [f"{where}: {p}" for p in delivery.problems]
            if delivery.sample_id in delivered:
                report.problems.append(f"{where}: delivered again after its ack")
            delivered.add(delivery.sample_id)
            rows[record.index].add(delivery.sample_id)
            if delivery.problems:
                reader.nack(delivery, "; ".join(delivery.problems))
            else:
                reader.ack(delivery)
        else:
            report.complete = True
        put = reader.redis.hlen(reader.keys.stream_current(name))
        report.problems += _dead_letters(reader)
    except KeyboardInterrupt:
        report.problems.append("interrupted before the stream ended")
        return report
    finally:
        reader.close()
    report.problems += [f"dataset row {row} is streamed under {len(ids)} sample ids: {sorted(ids)}"
                        for row, ids in sorted(rows.items()) if len(ids) > 1]  # fmt: skip
    if report.complete and put > len(delivered):
        report.warnings.append(f"{put - len(delivered)} of the run's {put} samples went to other consumers of group "
                               f"{reader.group} (or were settled before it joined)")  # fmt: skip
    return report


def _dead_letters(reader: StreamConsumer) -> list[str]:
    """The samples other consumers dead-lettered (this one's own are reported with their problems)."""
    out = []
    for sample_id, raw in sorted(reader.redis.hgetall(reader.keys.stream_dead(reader.name)).items()):
        why = json.loads(raw)
        if (why["group"], why["consumer"]) != (reader.group, reader.consumer):
            out.append(f"sample {sample_id.decode()}: dead-lettered by consumer {why['consumer']} of group "
                       f"{why['group']}: {why['why']}")  # fmt: skip
    return out


def _left(reader: StreamConsumer, idle_s: float) -> list[str]:
    """Why the stream has not ended after ``idle_s`` with nothing delivered: its run not ended, and each sample put
    and not acked, with where it is (its object gone, or its entry pending with a consumer)."""
    keys, name = reader.keys, reader.name
    out = []
    if reader.state() == "paused":
        out.append(f"nothing arrived for {idle_s:g}s: the stream is paused (its job is cancelled; resume the job)")
    elif reader.redis.hget(keys.stream_run(name), "ended") != b"1":
        out.append(f"nothing arrived for {idle_s:g}s and the run has not ended (its producer is slow, or gone)")
    acked = {*reader.redis.hkeys(keys.stream_acked(name)), *reader.redis.hkeys(keys.stream_dead(name)),
             *reader.redis.hkeys(keys.stream_group_acked(name, reader.group))}  # fmt: skip
    left = {
        k.decode(): v.decode() for k, v in reader.redis.hgetall(keys.stream_current(name)).items() if k not in acked
    }
    if not left:
        return out
    present = objects_present(reader.transfer.store, list(left.values()))
    taken = reader.redis.hmget(keys.stream_taken(name, reader.group), list(left))
    for (sample_id, handle), found, entry in zip(left.items(), present, taken, strict=True):
        pending = entry and reader.redis.xpending_range(reader.stream, reader.group, min=entry, max=entry, count=1)
        if not found:
            why = (f"its object {handle} is not in Mooncake Store (its producer died, or the master restarted: the "
                   f"run's resume puts it again)")  # fmt: skip
        elif pending:
            why = f"pending with consumer {pending[0]['consumer'].decode()}"
        else:
            why = "its object is there, its entry never delivered"
        out.append(f"sample {sample_id}: put and not acked within {idle_s:g}s: {why}")
    return out
