"""`layertap extract --stream mooncake --stream-only` against a real ``mooncake_master``, a real Redis and the CPU
SGLang server: no sample file is written, every sample reaches the consumers once and byte-equal to a files run of the
same rows (which streams them too, the both target: its consumer gets its files' bytes), and a producer SIGKILLed
mid-run is resumed by running the same command again: what a consumer acked is not computed again (the run folder's
reports name every sample each run computed), what it had put and no one acked is.
The first test's server writes speculators samples, so each is written by the server straight into the producer's
segment file (placed: nothing copied); the others' writes its own dumps, which the producer puts.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from harness.processes import LAYERTAP, Proc, wait_moving
from layertap.state.keys import Keys
from layertap.store.store import OutputStore
from layertap.verify import verify_store
from sglang_patch.contract import SEGMENT_PREFIX
from tests.core.datasets import conversation_rows, write_jsonl
from tests.sglang_fixtures import DEFAULT_LAYERS, SGLangServer
from tests.stream.test_stream import (
    CONSUME,
    ROWS,
    STALL_S,
    UNACKED,
    assert_byte_equal_to_store,
    env,
    first_acks,
    rerun_beside,
    stream_args,
)


def computed_by_run(out: Path) -> list[list[str]]:
    """The samples each run into ``out`` computed, oldest run first (its saved reports)."""
    reports = sorted((out / "reports").glob("run-*.json"), key=lambda p: p.stat().st_mtime_ns)
    return [json.loads(p.read_text())["computed"] for p in reports]


def files_run(cmd: list[str], out: Path, logs: Path) -> None:
    """The reference: ``cmd`` writing files into ``out``, waited for as long as its index grows."""
    run = Proc("files", [*cmd, "--out", str(out)], env(), logs / "files.log").start()
    wait_moving(lambda: run.popen.poll() is not None, stall=STALL_S, what="the files run to exit",
                moved=lambda: sum(p.stat().st_size for p in out.glob("index/*.jsonl")))  # fmt: skip
    assert run.popen.returncode == 0, run.log_tail()


@pytest.fixture
def sglang_llama_speculators(sglang_servers: Callable[..., SGLangServer], tiny_llama: Path) -> SGLangServer:
    """The CPU capture server writing speculators samples (float32, as it computes): the layout a run that streams
    a speculators store launches its server with."""
    return sglang_servers(tiny_llama, layers=DEFAULT_LAYERS["llama"], final="pre", layout="speculators")


def test_a_stream_only_run_writes_no_sample_and_a_killed_producer_resumes_without_recomputing_what_was_acked(
    sglang_llama_speculators, tiny_llama, mooncake_master, redis_server, redis_client, tmp_path
) -> None:
    server = sglang_llama_speculators
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(ROWS, seed=11, max_words=12))
    files, out, received, name, keys = tmp_path / "files", tmp_path / "out", tmp_path / "received", "only", Keys()
    # One request in flight, in both runs: each prefill a batch of its own, so both compute every sample identically.
    extract = [*LAYERTAP, "extract", "--model", str(tiny_llama), "--data", str(data), "--layers",
               ",".join(map(str, DEFAULT_LAYERS["llama"])), "--engine", "sglang", "--server-url", server.url,
               "--dump-root", str(server.dump_root), "--in-flight", "1", "--format", "speculators",
               "--store-dtype", "float32"]  # fmt: skip
    placed_before = server.log_path.read_text().count("(placed)")
    # The reference keeps files and streams them (the both target): the server writes each sample's file, committed
    # by a rename, and into its object; its consumer receives every sample byte-equal to its file.
    both = tmp_path / "both-received"
    reader = Proc("consumer-both", [*[sys.executable, str(CONSUME), redis_server.url, "both", mooncake_master.address],
                                    str(both), "--consumer", "a"], env(), tmp_path / "both.log").start()  # fmt: skip
    try:
        files_run([*extract, *stream_args(mooncake_master, redis_server, "both")], files, tmp_path)
        assert reader.popen.wait(timeout=60) == 0, reader.log_tail()
    finally:
        reader.kill(signal.SIGKILL)
    assert_byte_equal_to_store(files, both)
    assert verify_store(files).ok
    both_run = redis_client.hgetall(keys.stream_run("both"))
    assert both_run["put"] == both_run["placed"] == str(ROWS)  # each announced where the server wrote it: none copied

    streamed = [*extract, "--out", str(out), *stream_args(mooncake_master, redis_server, name), "--stream-only"]
    consume = [sys.executable, str(CONSUME), redis_server.url, name, mooncake_master.address, str(received)]
    first = Proc("consumer-a", [*consume, "--consumer", "a"], env(), tmp_path / "a.log").start()
    producer = Proc("extract", streamed, env(), tmp_path / "extract.log").start()
    procs = [first, producer]
    try:
        acked = lambda: redis_client.hlen(keys.stream_acked(name))  # noqa: E731
        wait_moving(lambda: acked() >= 40, moved=acked, stall=STALL_S, what="40 samples acked")
        producer.kill(signal.SIGKILL)  # mid-run: up to UNACKED samples put and not acked die with its segment
        first.kill(signal.SIGKILL)  # and the consumer holding one of them
        acked_before = set(redis_client.hkeys(keys.stream_acked(name)))
        rerun_beside(streamed, consume, tmp_path, procs, redis_client, name)
    finally:
        for proc in procs:
            proc.kill(signal.SIGKILL)

    store = OutputStore.open_existing(out)
    records = store.records()  # the acked samples, as the run folder mirrored them
    assert len(records) == ROWS and store.manifest.target == "stream" and store.manifest.complete
    assert not (out / "samples").exists() and not list(out.rglob("*.safetensors"))  # no sample file, ever
    # The run's record only: under 1 KiB a sample whatever its width (at hidden 64 a sample's states are ~37 KB, so
    # this is a few percent of them here; at Kimi-K2 width, ~57 KB a token, far under 1%).
    states = sum(r.nbytes for r in OutputStore.open_existing(files).records().values())
    folder = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    assert folder <= 1024 * ROWS and folder < 0.05 * states, (folder, states)
    # Acked exactly once each, across both producers and both consumers; byte-equal to the files run's samples.
    assert sorted(first_acks(tmp_path / "a.log", tmp_path / "b.log")) == sorted(records)
    assert_byte_equal_to_store(files, received)
    # The resumed run computed only what no consumer had acked: nothing acked before the kill was computed again.
    (rerun,) = computed_by_run(out)  # the killed run saved no report
    assert not set(rerun) & acked_before and set(rerun) | acked_before == set(records)
    assert len(acked_before) >= 40
    report = verify_store(out)
    assert report.ok and report.samples == ROWS and any("stream-verify" in w for w in report.warnings)
    # Each sample streamed was written by the server into its object (the killed producer's unacked ones twice), and
    # no segment file is left in the dump root: the killed producer's went when the rerun mounted its own.
    assert server.log_path.read_text().count("(placed)") - placed_before >= 2 * ROWS  # the both run's, then these
    assert not list(server.dump_root.glob(f"{SEGMENT_PREFIX}*"))


def test_stream_only_without_a_stream_is_refused_before_any_work(layertap_cli, tiny_llama, tmp_path) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(2, seed=1))
    result = layertap_cli("extract", "--model", str(tiny_llama), "--data", str(data), "--layers", "1,3,5", "--out",
                          str(tmp_path / "out"), "--stream-only")  # fmt: skip
    assert result.returncode == 2 and "--stream-only needs a stream" in result.stdout + result.stderr
    assert not (tmp_path / "out").exists()


def test_a_restarted_master_stops_a_stream_only_run_and_the_rerun_delivers_every_sample_once(
    tiny_llama, mooncake_master, redis_server, redis_client, tmp_path
) -> None:
    """In process (the HF engine, one sample a forward, so both runs compute each sample identically): the master
    forgets the objects put and not acked, the run stops in one line, and the same command run again computes those
    again, byte-equal to a files run, each delivered once."""
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(20, seed=8, max_words=10))
    files, out, received, name, keys = tmp_path / "files", tmp_path / "out", tmp_path / "received", "hf-only", Keys()
    extract = [*LAYERTAP, "extract", "--model", str(tiny_llama), "--data", str(data), "--layers", "1,3,5",
               "--batch-size", "1", "--format", "speculators"]  # fmt: skip
    files_run(extract, files, tmp_path)
    streamed = [*extract, "--out", str(out), *stream_args(mooncake_master, redis_server, name), "--stream-only"]
    consume = [sys.executable, str(CONSUME), redis_server.url, name, mooncake_master.address, str(received)]
    first = Proc("consumer-a", [*consume, "--consumer", "a", "--hang-after", "3"], env(), tmp_path / "a.log").start()
    producer = Proc("extract", streamed, env(), tmp_path / "extract.log").start()
    procs = [first, producer]
    try:
        put = lambda: redis_client.hget(keys.stream_run(name), "put")  # noqa: E731
        wait_moving(lambda: put() == str(2 + UNACKED), moved=put, stall=STALL_S, what="the producer at its bound")
        acked_before = set(redis_client.hkeys(keys.stream_acked(name)))
        mooncake_master.restart()  # the unacked objects are forgotten
        assert producer.popen.wait(timeout=60) == 2, producer.log_tail()
        first.kill(signal.SIGKILL)
        said = " ".join((tmp_path / "extract.log").read_text().split())
        assert said.count("error:") == 1 and "samples put and not acked are gone from Mooncake Store" in said
        rerun_beside(streamed, consume, tmp_path, procs, redis_client, name)
    finally:
        for proc in procs:
            proc.kill(signal.SIGKILL)

    records = OutputStore.open_existing(out).records()
    assert len(records) == 20 and not list(out.rglob("*.safetensors"))
    assert len(acked_before) == 2 and sorted(first_acks(tmp_path / "a.log", tmp_path / "b.log")) == sorted(records)
    assert_byte_equal_to_store(files, received)
    (rerun_computed,) = computed_by_run(out)  # the stopped run saved no report
    assert set(rerun_computed) == set(records) - acked_before
