"""A job that streams (#46): ``POST /jobs`` with ``stream: mooncake`` over two Celery workers (HF engine), each shard
attempt a producer of its own into the job's one stream (a real ``mooncake_master``, the session's Redis), read by a
consumer process with hs-connectors' own reader (tests/stream/consume.py): every sample of the job's store is
delivered once, byte-equal to its file; a worker SIGKILLed holding unacked samples loses none and delivers none twice
(the shard's next attempt puts again exactly what no consumer acked); a cancelled job's stream reads paused to its
consumers (and stream-verify), and resumes with the job.

The waits for a job are on its progress (samples, shards, the stream's acks), not on a wall-clock budget: a slow
machine is waited on, a stuck job fails once nothing moved for `STALL_S`."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from harness.mooncake import MooncakeMaster
from harness.processes import LAYERTAP, Proc, wait_for
from harness.services import RedisServer
from layertap.state.keys import Keys
from layertap.store.store import OutputStore
from layertap.stream.consumer import StreamConsumer
from tests.core.datasets import conversation_rows, write_jsonl
from tests.monitoring.test_live import scraped
from tests.stream.test_stream import CONSUME, assert_byte_equal_to_store, env, first_acks

ROWS, SHARD = 40, 10
UNACKED = 3  # each producer's bound


def job_fields(master: MooncakeMaster, redis: RedisServer, name: str) -> dict:
    """The job's shards and stream, as POST /jobs takes them (the fields `layertap submit` and `extract` take as
    flags)."""
    return {"shard_size": SHARD, "format": "speculators", "stream": "mooncake", "mooncake_master": master.address,
            "stream_redis_url": redis.url, "stream_name": name, "stream_unacked": UNACKED}  # fmt: skip


def consumer(redis: RedisServer, master: MooncakeMaster, name: str, folder: Path, who: str, *args: str) -> Proc:
    cmd = [sys.executable, str(CONSUME), redis.url, name, master.address, str(folder / "received"), "--consumer",
           who, *args]  # fmt: skip
    return Proc(f"consumer-{who}", cmd, env(), folder / f"{who}.log").start()


def acks(state, name: str):
    """What moves while a streamed job's producers wait at their bound: the stream's acks, and its puts."""
    keys = Keys()
    return lambda: (state.hlen(keys.stream_acked(name)), state.hget(keys.stream_run(name), "put"))


def test_a_streamed_job_delivers_every_sample_once_byte_equal_to_its_store(
    start_cluster, tiny_llama, mooncake_master, redis_server, tmp_path
) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(ROWS, seed=11, max_words=10))
    cluster = start_cluster(workers=2)
    name, keys = "job-stream", Keys()
    reader = consumer(redis_server, mooncake_master, name, tmp_path, "a")
    try:
        job_id = cluster.submit(tiny_llama, data, **job_fields(mooncake_master, redis_server, name))
        job = cluster.wait_state(job_id, "done", moving=acks(cluster.state, name))
        assert reader.popen.wait(timeout=60) == 0, reader.log_tail()  # it ends: the job ended its stream
    finally:
        reader.kill(signal.SIGKILL)

    out = Path(job["out"])
    records = OutputStore.open_existing(out).records()
    assert len(records) == ROWS and job["samples_done"] == ROWS
    state = cluster.state
    assert state.hget(keys.stream_run(name), "ended") == "1"
    entries = [fields for _, fields in state.xrange(keys.stream(name))]
    assert sorted(e["sample_id"] for e in entries) == sorted(records)  # each put once: nothing to put again
    assert sorted(first_acks(tmp_path / "a.log")) == sorted(records)
    assert state.xpending(keys.stream(name), "trainers")["pending"] == 0
    assert_byte_equal_to_store(out, tmp_path / "received")
    # Each worker mounted its segment once for its shards, not once an attempt (Mooncake's close freezes it ~2 s).
    assert scraped(mooncake_master.metrics_url)[("master_mount_segment_requests_total", ())] <= 2 < ROWS // SHARD


def test_a_worker_killed_holding_unacked_samples_loses_none_and_delivers_none_twice(
    start_cluster, tiny_llama, mooncake_master, redis_server, tmp_path
) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(ROWS, seed=12, max_words=10))
    cluster = start_cluster(workers=2)
    name, keys, state = "job-killed", Keys(), cluster.state
    # The first consumer acks two samples and dies holding the third: the producers fill up to their bounds.
    first = consumer(redis_server, mooncake_master, name, tmp_path, "a", "--hang-after", "3")
    procs = [first]
    try:
        job_id = cluster.submit(tiny_llama, data, **job_fields(mooncake_master, redis_server, name))
        wait_for(lambda: (tmp_path / "received" / "hung").exists(), timeout=120, what="the consumer's third sample")

        def holder() -> dict | None:
            """A running shard whose attempt put samples no consumer acked (its worker at the bound)."""
            unacked = set(state.hkeys(keys.stream_current(name))) - set(state.hkeys(keys.stream_acked(name)))
            rows = {int(state.hget(keys.stream_current(name), s).rsplit("-", 1)[1]) for s in unacked}
            for n, shard in enumerate(cluster.shards(job_id)):
                held = {r for r in rows if n * SHARD <= r < (n + 1) * SHARD}
                if shard.get("state") == "running" and len(held) >= UNACKED:
                    return {**shard, "n": n, "held": held}
            return None

        victim = wait_for(holder, timeout=120, what="a worker at its bound", every=0.1)
        entries_before = state.xlen(keys.stream(name))
        cluster.workers[victim["worker"]].kill(signal.SIGKILL)  # its segment, and the samples in it, go with it
        first.kill(signal.SIGKILL)
        second = consumer(redis_server, mooncake_master, name, tmp_path, "b", "--claim-idle-ms", "1000")
        procs.append(second)
        job = cluster.wait_state(job_id, "done", moving=acks(state, name))
        assert second.popen.wait(timeout=60) == 0, second.log_tail()
    finally:
        for proc in procs:
            proc.kill(signal.SIGKILL)

    out = Path(job["out"])
    records = OutputStore.open_existing(out).records()
    assert len(records) == ROWS
    shard = cluster.shards(job_id)[victim["n"]]
    assert int(shard["attempts"]) >= 2 and shard["worker"] != victim["worker"]  # the other worker took it over
    later = [fields for _, fields in state.xrange(keys.stream(name))][entries_before:]
    held_ids = {sid for sid in records if records[sid].index in victim["held"]}
    assert held_ids <= {e["sample_id"] for e in later}  # what died unacked was put again
    assert sorted(first_acks(tmp_path / "a.log", tmp_path / "b.log")) == sorted(records)  # all, none twice
    assert state.xpending(keys.stream(name), "trainers")["pending"] == 0
    assert_byte_equal_to_store(out, tmp_path / "received")


def test_a_cancelled_jobs_stream_reads_paused_to_its_consumers_and_resumes_with_the_job(
    start_cluster, tiny_llama, mooncake_master, redis_server, tmp_path
) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(20, seed=13, max_words=10))
    cluster = start_cluster(workers=1)
    name, keys, state = "job-paused", Keys(), cluster.state
    # A consumer of the trainers' group that only watches (it registers the group the job's samples wait for).
    watcher = StreamConsumer(redis_server.url, name, master=mooncake_master.address, block_ms=100)
    procs = []
    try:
        job_id = cluster.submit(tiny_llama, data, **job_fields(mooncake_master, redis_server, name))
        wait_for(lambda: state.hget(keys.stream_run(name), "put") == str(UNACKED), timeout=120,
                 what="the shard's producer at its bound")  # fmt: skip
        assert watcher.state() == "running"
        with cluster.api() as api:
            assert api.post(f"/jobs/{job_id}/cancel").status_code == 200
            assert watcher.state() == "paused" and state.hget(keys.stream_run(name), "paused") == "1"
            (view,) = api.get("/streams").json()["streams"]
            assert view["state"] == "paused"
            verified = Proc("stream-verify", [*LAYERTAP, "stream-verify", name, "--mooncake-master",
                                              mooncake_master.address, "--stream-redis-url", redis_server.url,
                                              "--group", "trainers", "--consumer", "verifier", "--idle-timeout", "3"],
                            env(), tmp_path / "verify.log").start()  # fmt: skip
            procs.append(verified)
            assert verified.popen.wait(timeout=120) == 1, verified.log_tail()
            said = " ".join((tmp_path / "verify.log").read_text().split())
            assert "the stream is paused (its job is cancelled; resume the job)" in said, said
            assert api.post(f"/jobs/{job_id}/resume").status_code == 200
            assert watcher.state() == "running" and state.hget(keys.stream_run(name), "paused") is None
        reader = consumer(redis_server, mooncake_master, name, tmp_path, "a", "--claim-idle-ms", "1000")
        procs.append(reader)
        job = cluster.wait_state(job_id, "done", moving=acks(state, name))
        assert reader.popen.wait(timeout=60) == 0, reader.log_tail()
        assert watcher.state() == "ended"
    finally:
        watcher.close()
        for proc in procs:
            proc.kill(signal.SIGKILL)

    records = OutputStore.open_existing(Path(job["out"])).records()
    assert len(records) == 20 and sorted(state.hkeys(keys.stream_acked(name))) == sorted(records)


def test_a_stream_only_job_writes_no_sample_and_its_store_records_what_was_acked(
    start_cluster, tiny_llama, mooncake_master, redis_server, tmp_path
) -> None:
    """``stream_only``: each shard attempt puts its samples from the capture and writes none; the job is done once
    every sample is acked, and its folder's index then holds exactly the acked samples."""
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(ROWS, seed=13, max_words=10))
    cluster = start_cluster(workers=2)
    name, keys = "job-only", Keys()
    reader = consumer(redis_server, mooncake_master, name, tmp_path, "a")
    try:
        fields = {**job_fields(mooncake_master, redis_server, name), "stream_only": True}
        job_id = cluster.submit(tiny_llama, data, **fields)
        job = cluster.wait_state(job_id, "done", moving=acks(cluster.state, name))
        assert reader.popen.wait(timeout=60) == 0, reader.log_tail()
    finally:
        reader.kill(signal.SIGKILL)

    out = Path(job["out"])
    store = OutputStore.open_existing(out)
    records = store.records()
    assert store.manifest.target == "stream" and store.manifest.samples_committed == ROWS == len(records)
    assert not list(out.rglob("*.safetensors"))
    acked = cluster.state.hgetall(keys.stream_acked(name))
    assert sorted(acked) == sorted(records) == sorted(first_acks(tmp_path / "a.log"))  # each once, all recorded
    received = sorted(p.stem for p in (tmp_path / "received").glob("*.safetensors"))
    assert received == sorted(records)
