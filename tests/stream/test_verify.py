"""`layertap stream-verify` as the one consumer of a run's stream (a real ``mooncake_master`` on loopback, a real
Redis, the run's producer a real ``layertap extract --stream mooncake`` with the HF engine): a run's samples verified
clean and acked, so the run ends; samples put beside the run's through the real store, each wrong in one way (another
run's identity, a shape, a dtype, a loss mask, an object never put), each reported by its sample, exit 1."""

from __future__ import annotations

import dataclasses
import json
import signal

import torch
from redis import Redis

from harness.mooncake import MooncakeMaster
from harness.processes import LAYERTAP, Proc, wait_for
from harness.services import RedisServer
from layertap.state.keys import Keys
from layertap.store.store import OutputStore
from layertap.stream.mooncake import connect, disconnect, fingerprint, sample_manifest
from tests.core.datasets import conversation_rows, write_jsonl
from tests.stream.test_stream import env, stream_args


def streamed_run(
    tiny_llama, master: MooncakeMaster, redis: RedisServer, tmp_path, name: str, rows: int, log: str = "extract.log"
) -> Proc:
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(rows, seed=11, max_words=10))
    return Proc("extract", [*LAYERTAP, "extract", "--model", str(tiny_llama), "--data", str(data), "--layers", "1,3,5",
                            "--out", str(tmp_path / "out"), *stream_args(master, redis, name)],
                env(), tmp_path / log).start()  # fmt: skip


def stream_verify(layertap_cli, master: MooncakeMaster, redis: RedisServer, name: str, *args: str):
    return layertap_cli("stream-verify", name, "--mooncake-master", master.address, "--stream-redis-url", redis.url,
                        "--consumer", "verifier", *args, timeout=300)  # fmt: skip


def test_a_streamed_run_verifies_clean_and_ends_once_the_verifier_acked_every_sample(
    tiny_llama, mooncake_master, redis_server, redis_client, layertap_cli, tmp_path
) -> None:
    name, keys = "hf-verified", Keys()
    producer = streamed_run(tiny_llama, mooncake_master, redis_server, tmp_path, name, rows=10)
    try:
        run = stream_verify(layertap_cli, mooncake_master, redis_server, name)
        assert producer.popen.wait(timeout=120) == 0, producer.log_tail()
    finally:
        producer.kill(signal.SIGKILL)
    records = OutputStore.open_existing(tmp_path / "out").records()
    tokens = sum(r.num_tokens for r in records.values())
    assert run.returncode == 0, run.stderr
    assert "problem" not in run.stderr and "warning" not in run.stderr
    assert f"stream-verify stream {name}: 10 samples, {tokens:,} tokens, " in run.stderr and "clean" in run.stderr
    assert redis_client.hgetall(keys.stream_acked(name)) == dict.fromkeys(records, "verifier")


def put_beside(redis: Redis, name: str, manifest: dict, tensors: dict[str, torch.Tensor] | None, store) -> None:
    """Put a sample as `MooncakeSink.put` does (its object, then its entry and current handle in one MULTI); no
    object with ``tensors`` None."""
    if tensors is not None:
        store.put_sample(manifest, tensors)
    sample_id, keys = manifest["metadata"]["layertap"]["sample_id"], Keys()
    with redis.pipeline() as pipe:
        pipe.hset(keys.stream_current(name), sample_id, manifest["handle"])
        pipe.xadd(keys.stream(name), {"sample_id": sample_id, "manifest": json.dumps(manifest)})
        pipe.execute()


def test_samples_wrong_in_any_way_are_each_a_problem_named_by_its_sample(
    tiny_llama, mooncake_master, redis_server, redis_client, layertap_cli, tmp_path
) -> None:
    name, keys, out = "hf-forged", Keys(), tmp_path / "out"
    producer = streamed_run(tiny_llama, mooncake_master, redis_server, tmp_path, name, rows=3)
    store = connect(mooncake_master.address, segment_bytes=64 << 20, pin=True)  # the forged objects live here
    try:
        wait_for(lambda: redis_client.hget(keys.stream_run(name), "ended") == "1", timeout=120,
                 what="the run's samples put")  # fmt: skip
        files = OutputStore.open_existing(out)
        real = min(files.records().values(), key=lambda r: r.index)  # forged from: the run's first sample
        run = redis_client.hget(keys.stream_run(name), "fingerprint")
        tensors = {**files.format.load(out / real.file), "loss_mask": real.loss_mask()}
        states = tensors["hidden_states"]
        t, k1, h = states.shape

        def forge(sample_id: str, row: int, *, by: str = run, record: dict | None = None, **change: torch.Tensor):
            forged = {**tensors, **change}
            manifest = sample_manifest(f"forged-{sample_id}", forged,
                                       dataclasses.replace(real, sample_id=sample_id, index=row, **(record or {})), by)  # fmt: skip
            return manifest, forged

        other_run = fingerprint({"model_config_sha256": "another model"})
        for manifest, forged in [
            forge("other-run", 100, by=other_run),
            forge("narrow", 101, hidden_states=states[..., : h - 1].contiguous()),
            forge("half", 102, hidden_states=states.to(torch.float16)),
            forge("mask", 103, record={"mask_runs": ((0, 1),)}),
        ]:
            put_beside(redis_client, name, manifest, forged, store)
        missing, _ = forge("missing", 104)
        put_beside(redis_client, name, missing, None, store)

        verified = stream_verify(layertap_cli, mooncake_master, redis_server, name, "--idle-timeout", "4")
        assert producer.popen.wait(timeout=120) == 0, producer.log_tail()  # its own samples acked by the verifier
    finally:
        producer.kill(signal.SIGKILL)
        disconnect(store)

    said = [" ".join(line.split()) for line in verified.stderr.splitlines() if line.startswith("problem:")]
    assert said == [
        f"problem: sample other-run (row 100): put by another run (fingerprint {other_run[:12]}, the stream's run is "
        f"{run[:12]})",
        f"problem: sample narrow (row 101): hidden_states: shape {(t, k1, h - 1)} != expected {(t, k1, h)}",
        f"problem: sample half (row 102): hidden_states: dtype float16 != expected {str(states.dtype)[6:]}",
        "problem: sample mask (row 103): loss_mask differs from the manifest's runs",
        "problem: sample missing: put and not acked within 4s: its object forged-missing is not in Mooncake Store "
        "(its producer died, or the master restarted: the run's resume puts it again)",
    ], verified.stderr
    assert verified.returncode == 1
    assert f"stream-verify stream {name}: 7 samples, " in verified.stderr and "5 problems" in verified.stderr
