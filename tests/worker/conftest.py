"""A running cluster for the distributed tests: Redis, a uvicorn coordinator, Celery workers (HF engine).

Every job here uses the HF engine one sample per forward (``batch_size`` 1), so a sample's bytes do
not depend on which samples shared its batch: any run, interrupted or not, must reproduce the
single-process reference run byte for byte.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from redis import Redis

from harness.processes import REPO_ROOT, Proc, wait_for, wait_moving
from harness.services import Coordinator, RedisServer, Services
from layertap.pipeline import run_extraction
from layertap.spec import ExtractionSpec
from layertap.state.keys import Keys
from layertap.store.index import INDEX_DIR, read_jsonl_dir
from layertap.store.store import OutputStore
from layertap.verify import verify_store
from tests.core.datasets import conversation_rows, write_jsonl
from tests.core.trainer_reads import masked_token_counts, token_freq_file
from tests.hf_engines import cpu_hf

LAYERS = (1, 3, 5)
NUM_SAMPLES = 300
SHARD_SIZE = 25
STALL_S = 120  # a job that moved nothing (samples, shards, acks) for this long is stuck, however slow the machine


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """300 conversations of about 20 to 200 tokens."""
    return write_jsonl(
        tmp_path_factory.mktemp("corpus") / "data.jsonl", conversation_rows(NUM_SAMPLES, seed=2, max_words=18)
    )


@pytest.fixture(scope="session")
def reference_store(tiny_llama: Path, corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output of an uninterrupted single-process run (``layertap extract``'s path) over the corpus."""
    out = tmp_path_factory.mktemp("reference") / "out"
    spec = ExtractionSpec(model=tiny_llama, data=corpus, layers=LAYERS)
    run_extraction(spec, out, cpu_hf(batch_size=1))
    return out


@pytest.fixture(scope="session")
def reference(reference_store: Path) -> dict[str, str]:
    """sample id -> sha256 of its file in the reference run."""
    return {r.sample_id: r.sha256 for r in OutputStore.open_existing(reference_store).records().values()}


@dataclass
class Cluster:
    """One coordinator and its workers over one Redis."""

    services: Services
    redis: RedisServer
    output_root: Path
    coordinator: Coordinator
    workers: dict[str, Proc] = field(default_factory=dict)
    keys: Keys = field(default_factory=Keys)

    @property
    def state(self) -> Redis:
        return Redis.from_url(self.redis.url, decode_responses=True)

    def api(self) -> httpx.Client:
        return self.coordinator.client()

    def add_worker(self, name: str, **env: str) -> Proc:
        self.workers[name] = self.services.worker(name, self.redis.url, **env)
        return self.workers[name]

    def restart_coordinator(self) -> None:
        """Start a coordinator on the same port, through ``layertap coordinator`` this time."""
        port = int(self.coordinator.url.rsplit(":", 1)[1])
        self.coordinator = self.services.coordinator(
            self.redis.url, self.output_root, port=port, token=self.coordinator.token, cli=True
        )

    def submit(self, model: Path, data: Path, **extra) -> str:
        body = {"model": str(model), "data": str(data), "layers": list(LAYERS), "shard_size": SHARD_SIZE,
                "engine": {"batch_size": 1}, **extra}  # fmt: skip
        with self.api() as api:
            reply = api.post("/jobs", json=body)
        assert reply.status_code == 201, reply.text
        return reply.json()["job_id"]

    def job(self, job_id: str) -> dict:
        with self.api() as api:
            reply = api.get(f"/jobs/{job_id}")
        assert reply.status_code == 200, reply.text
        return reply.json()

    def wait_state(
        self, job_id: str, *states: str, stall: float = STALL_S, moving: Callable[[], object] = lambda: None
    ) -> dict:
        """Poll the API until the job is in one of ``states`` (riding out a coordinator or Redis restart), for as
        long as it moves: its samples and shards, or what ``moving`` reads (a stream's acks), change within every
        ``stall`` s."""
        seen: dict = {}

        def reached() -> dict | None:
            try:
                seen["job"] = job = self.job(job_id)
            except (httpx.HTTPError, AssertionError):
                return None
            if job["state"] == "failed" and "failed" not in states:
                pytest.fail(f"job failed: {job}")
            return job if job["state"] in states else None

        def moved() -> object:
            job = seen.get("job", {})
            return [job.get(k) for k in ("state", "samples_done", "samples_failed", "shards")], moving()

        return wait_moving(reached, moved=moved, stall=stall, what=f"job {job_id} to be {'/'.join(states)}",
                           every=0.25)  # fmt: skip

    def shards(self, job_id: str) -> list[dict]:
        state = self.state
        count = int(state.hget(self.keys.job(job_id), "num_shards"))
        return [state.hgetall(self.keys.shard(job_id, n)) for n in range(count)]

    def samples_done(self, job_id: str) -> int:
        """Samples counted in Redis (read directly: works while the coordinator is down)."""
        return sum(int(shard.get("done", 0)) for shard in self.shards(job_id))

    def freeze_mid_shard(self, job_id: str, *, all_workers: bool = False) -> dict:
        """SIGSTOP the worker of a shard that has committed some but not all of its samples (or every
        worker, with ``all_workers``); returns that shard as read while frozen (``n`` = its number).

        Freezing first makes "mid-shard" certain: the shard is read again while nothing can move. At
        most 13 of 25 samples are done then, so the commits already under way cannot finish the shard.
        """

        def frozen() -> dict | None:
            for n, shard in enumerate(self.shards(job_id)):
                if shard.get("state") != "running" or not 2 <= int(shard.get("done", 0)) <= SHARD_SIZE - 12:
                    continue
                victims = list(self.workers.values()) if all_workers else [self.workers[shard["worker"]]]
                for proc in victims:
                    proc.send_signal(signal.SIGSTOP)
                now = self.shards(job_id)[n]
                if now["state"] == "running" and now["token"] == shard["token"] and int(now["done"]) < SHARD_SIZE:
                    return now | {"n": n}
                self.thaw()
            return None

        return wait_for(frozen, timeout=120, what="a worker in the middle of a shard", every=0.01)

    def thaw(self) -> None:
        for proc in self.workers.values():
            if proc.alive():
                proc.send_signal(signal.SIGCONT)


@pytest.fixture
def start_cluster(services: Services, redis_server: RedisServer, redis_client: Redis, tmp_path: Path) -> Callable:
    """``start_cluster(workers=2, redis=None, token=None, **env)`` -> a running ``Cluster`` (the session Redis by
    default); ``env`` (e.g. ``LAYERTAP_ALLOW_REMOTE_CODE="1"``) goes to the coordinator and every worker."""

    def start(workers: int = 2, redis: RedisServer | None = None, token: str | None = None, **env: str) -> Cluster:
        redis = redis or redis_server
        output_root = tmp_path / "outputs"
        output_root.mkdir(exist_ok=True)
        # Start the workers first: they import torch, the slow part; the coordinator starts meanwhile.
        procs = {f"w{i + 1}": services.worker(f"w{i + 1}", redis.url, wait=False, **env) for i in range(workers)}
        coordinator = services.coordinator(redis.url, output_root, token=token, **env)
        cluster = Cluster(services, redis, output_root, coordinator)
        for proc in procs.values():
            services.wait_ready(proc)
        cluster.workers.update(procs)
        return cluster

    return start


def layertap(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the ``layertap`` command line (as a user would) with extra environment variables."""
    return subprocess.run(
        [sys.executable, "-m", "layertap", *args], capture_output=True, text=True, timeout=600,
        env={**os.environ, **(env or {})}, cwd=REPO_ROOT,
    )  # fmt: skip


def check_output(out: Path, reference: dict[str, str], *, missing: set[str] = frozenset()) -> None:
    """The store holds every reference sample but ``missing`` exactly once, byte-identical, and verifies clean."""
    report = verify_store(out)
    assert report.ok, report.problems
    assert report.complete and not report.warnings, report.warnings
    records = OutputStore.open_existing(out).records()
    assert {sid: r.sha256 for sid, r in records.items()} == {
        sid: sha for sid, sha in reference.items() if sid not in missing
    }
    # Exactly once: one index line per sample over every writer's log (no sample committed twice).
    lines = Counter(d["sample_id"] for d in read_jsonl_dir(out / INDEX_DIR))
    assert max(lines.values()) == 1, [sid for sid, n in lines.items() if n > 1]
    assert json.loads((out / "manifest.json").read_text())["samples_committed"] == len(reference) - len(missing)
    # token_freq.pt merges the workers' per-sample counts: it equals a recount from the stored samples.
    assert token_freq_file(out) == dict(masked_token_counts(out)) and (out / "TRAIN.md").exists()
