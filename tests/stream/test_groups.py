"""Several consumer groups on one stream, and its dead-letter list (a real ``mooncake_master`` on loopback, a real
Redis, a real ``layertap extract --stream mooncake`` producer with the HF engine): a trainers' group
(tests/stream/consume.py) and ``layertap stream-verify`` (its own group) each get every sample, an object removed
only once both acked; a sample whose object is altered after its put is dead-lettered, shown (the streams view,
metrics, the producer's line, stream-verify's problems), and settles its producer, which ends saying not all were
delivered; the command run again puts nothing again (the dead-lettered sample counted, not put: no consumer would read
or remove it) and ends as honestly."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

from redis import Redis

from harness.mooncake import MooncakeMaster
from harness.processes import LAYERTAP, Proc, wait_for
from harness.services import RedisServer
from layertap.state.keys import Keys
from layertap.store.store import OutputStore
from layertap.stream.mooncake import connect, disconnect
from tests.monitoring.test_live import scraped
from tests.stream.test_stream import CONSUME, UNACKED, env, exit_code
from tests.stream.test_verify import streamed_run


def consumer(redis: RedisServer, master: MooncakeMaster, name: str, folder: Path, *args: str) -> Proc:
    """consume.py in the trainers' group as consumer ``a``."""
    cmd = [sys.executable, str(CONSUME), redis.url, name, master.address, str(folder / "received"), "--consumer", "a",
           *args]  # fmt: skip
    return Proc("consumer-a", cmd, env(), folder / "a.log").start()


def verifier(redis: RedisServer, master: MooncakeMaster, name: str, folder: Path) -> Proc:
    """``layertap stream-verify`` in its own group (the default) as consumer ``verifier``."""
    cmd = [*LAYERTAP, "stream-verify", name, "--mooncake-master", master.address, "--stream-redis-url", redis.url,
           "--consumer", "verifier"]  # fmt: skip
    return Proc("stream-verify", cmd, env(), folder / "verify.log").start()


def said(log: Path) -> str:
    return " ".join(log.read_text().split())  # the console wraps its lines


def test_two_groups_each_get_every_sample_and_an_object_goes_once_both_acked(
    tiny_llama, mooncake_master, redis_server, redis_client, tmp_path
) -> None:
    name, keys, rows = "hf-two-groups", Keys(), 10
    trainer = consumer(redis_server, mooncake_master, name, tmp_path, "--hang-after", "3")
    checker = verifier(redis_server, mooncake_master, name, tmp_path)
    procs = [trainer, checker]
    try:
        wait_for(lambda: redis_client.hlen(keys.stream_groups(name)) == 2, timeout=120, what="both groups registered")
        producer = streamed_run(tiny_llama, mooncake_master, redis_server, tmp_path, name, rows=rows)
        procs.append(producer)
        # The trainer acks 2 and sits on its 3rd; the verifier acks all the producer puts before it is held.
        wait_for(lambda: redis_client.hget(keys.stream_run(name), "put") == str(2 + UNACKED)
                 and redis_client.hlen(keys.stream_group_acked(name, "stream-verify")) == 2 + UNACKED
                 and redis_client.hlen(keys.stream_held(name)) == 1, timeout=120,
                 what="the producer held, the verifier's group past it")  # fmt: skip
        assert redis_client.hlen(keys.stream_acked(name)) == 2  # delivered: acked by both groups
        assert redis_client.hlen(keys.stream_group_acked(name, "trainers")) == 2
        assert scraped(mooncake_master.metrics_url)[("master_key_count", ())] == UNACKED  # the verifier's acks kept
        trainer.send_signal(signal.SIGUSR1)
        assert exit_code(producer, redis_client, name) == 0, producer.log_tail()
        assert trainer.popen.wait(timeout=60) == 0, trainer.log_tail()
        assert checker.popen.wait(timeout=60) == 0, checker.log_tail()
    finally:
        for proc in procs:
            proc.kill(signal.SIGKILL)

    records = sorted(OutputStore.open_existing(tmp_path / "out").records())
    assert len(records) == rows
    for group in ("trainers", "stream-verify"):  # each group got every sample
        assert sorted(redis_client.hkeys(keys.stream_group_acked(name, group))) == records
    by = redis_client.hgetall(keys.stream_acked(name))
    assert sorted(by) == records and set(by.values()) <= {"a", "verifier"}
    acks = [line.split() for line in (tmp_path / "a.log").read_text().splitlines() if line.startswith("acked ")]
    assert sorted(sample_id for _, sample_id, _, _ in acks) == records
    for _, sample_id, _, exists in acks:  # the trainer's ack removed the object only when it was the last
        assert exists == ("0" if by[sample_id] == "a" else "1") or by[sample_id] == "verifier", (sample_id, exists)
    assert scraped(mooncake_master.metrics_url)[("master_key_count", ())] == 0
    assert f"stream-verify stream {name}: {rows} samples, " in said(tmp_path / "verify.log")
    assert f"stream {name}: {rows} put, {rows} acked, 0 in flight (bound {UNACKED}), every one acked" in said(
        tmp_path / "extract.log"
    )


def corrupt_first_sample(redis: Redis, master: MooncakeMaster, name: str):
    """The stream's first sample altered in Mooncake Store after its put (a token id changed): its object replaced
    by one in a segment of the test's own (returned: keep it mounted). Returns (that store, the sample id)."""
    keys = Keys()
    _, fields = redis.xrange(keys.stream(name), count=1)[0]
    manifest = json.loads(fields["manifest"])
    store = connect(master.address, segment_bytes=64 << 20, pin=True)
    tensors = store.get_sample(manifest, timeout=5)
    tensors["token_ids"][0] += 1
    store.delete_sample(manifest["handle"])
    store.put_sample(manifest, tensors)
    return store, fields["sample_id"]


def test_a_sample_altered_after_its_put_is_dead_lettered_shown_and_settles_its_producer(
    tiny_llama, mooncake_master, redis_server, redis_client, services, tmp_path
) -> None:
    coordinator = services.coordinator(redis_server.url, tmp_path / "outputs")
    name, keys, rows = "hf-dead", Keys(), 8
    producer = streamed_run(tiny_llama, mooncake_master, redis_server, tmp_path, name, rows=rows)
    procs = [producer]
    store = None
    try:  # no consumer yet: the producer puts UNACKED samples and waits
        wait_for(lambda: redis_client.hget(keys.stream_run(name), "put") == str(UNACKED)
                 and redis_client.hlen(keys.stream_held(name)) == 1, timeout=120, what="the producer held")  # fmt: skip
        store, bad = corrupt_first_sample(redis_client, mooncake_master, name)
        procs += [consumer(redis_server, mooncake_master, name, tmp_path), verifier(redis_server, mooncake_master,
                                                                                     name, tmp_path)]  # fmt: skip
        # Settled, so it does not wait for ever; the dead letter counts against the run (1 bad row of 8 > 1%).
        assert exit_code(producer, redis_client, name) == 1, producer.log_tail()
        assert procs[1].popen.wait(timeout=60) == 0, procs[1].log_tail()
        assert procs[2].popen.wait(timeout=60) == 1, procs[2].log_tail()
    finally:
        for proc in procs:
            proc.kill(signal.SIGKILL)
        if store is not None:
            disconnect(store)

    dead = {k: json.loads(v) for k, v in redis_client.hgetall(keys.stream_dead(name)).items()}
    assert list(dead) == [bad] and dead[bad]["why"] == "input_ids differ from the index record", dead
    assert sorted(redis_client.hkeys(keys.stream_acked(name))) == sorted(
        set(OutputStore.open_existing(tmp_path / "out").records()) - {bad}
    )
    line = (f"stream {name}: {rows} put, {rows - 1} acked, 1 dead-lettered, 0 in flight (bound {UNACKED}), every one "
            "settled, not all delivered")  # fmt: skip
    assert line in said(tmp_path / "extract.log")
    assert "failed: 1 bad rows of 8" in said(tmp_path / "extract.log") and "dead_letter 1" in said(
        tmp_path / "extract.log"
    )
    problems = said(tmp_path / "verify.log").split("problem: ")[1:]  # its own, or the trainer's dead letter
    assert len(problems) == 1 and f"sample {bad}" in problems[0], problems
    assert "input_ids differ from the index record" in problems[0] and "1 problems" in problems[0]
    (view,) = coordinator.client().get("/streams").json()["streams"]
    assert (view["state"], view["put"], view["acked"], view["dead"], view["in_flight"]) == (
        "done",
        rows,
        rows - 1,
        1,
        0,
    )
    metrics = scraped(f"{coordinator.url}/metrics")
    assert metrics[("layertap_stream_samples", (("status", "dead"), ("stream", name)))] == 1
    assert scraped(mooncake_master.metrics_url)[("master_key_count", ())] == 0

    rerun = streamed_run(tiny_llama, mooncake_master, redis_server, tmp_path, name, rows=rows, log="rerun.log")
    try:
        assert exit_code(rerun, redis_client, name) == 1, rerun.log_tail()
    finally:
        rerun.kill(signal.SIGKILL)
    assert (redis_client.hget(keys.stream_run(name), "put"), redis_client.xlen(keys.stream(name))) == ("8", rows)
    assert "1 dead-lettered by a consumer" in said(tmp_path / "rerun.log"), said(tmp_path / "rerun.log")
