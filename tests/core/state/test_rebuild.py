"""Rebuilding a job's Redis state from its store after Redis lost everything."""

from pathlib import Path

import pytest

from layertap.engines.factory import sglang_engine_factory
from layertap.errors import StoreError
from layertap.pipeline import Committed, ProgressEvents, Run, plan_run, target_for
from layertap.settings import RunSettings
from layertap.state.model import JobSpec
from layertap.state.plan import plan_job
from layertap.state.rebuild import rebuild_job
from layertap.state.views import job_errors, job_view
from layertap.store.store import OutputStore
from tests.core.datasets import conversation_rows, write_jsonl
from tests.core.state.support import KEYS
from tests.hf_engines import hf_engine
from tests.sglang_fixtures import DEFAULT_LAYERS


class StopAfter(ProgressEvents):
    """Stops a shard after ``n`` commits, as a cancel or a lost lease would."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.left = n

    def committed(self, done: Committed) -> None:
        self.left -= 1

    def keep_going(self) -> bool:
        return self.left > 0


def test_rebuild_counts_what_the_store_holds_and_leaves_the_rest_pending(tiny_llama, tmp_path, redis_client) -> None:
    rows = conversation_rows(30, seed=4)
    rows[13] = {"id": "no-assistant", "messages": [{"role": "user", "content": "hello?"}]}
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    spec = JobSpec(model=tiny_llama, data=data, layers=(1, 3, 5), out=Path("job"), shard_size=10)
    planned = plan_job(spec, output_root=tmp_path / "outputs", job_id="job7")
    store = OutputStore.open_existing(planned.spec.out)
    engine = hf_engine(tiny_llama, spec.resolve(6), batch_size=1)
    plan = plan_run(spec.extraction(), stored=store.manifest).on(engine)
    run = Run(plan, engine, store, target_for(store, None))
    run.rows(0, 10)
    run.rows(10, 20)  # row 13 is bad
    partial = run.rows(20, 30, StopAfter(4))
    assert partial.stopped and 4 <= len(partial.computed) < 10  # the sample in flight may finish too
    store.close()
    tokens = {r.sample_id: r.num_tokens for r in store.records().values()}

    rebuilt = rebuild_job(redis_client, KEYS, planned.spec.out)
    done = 10 + 9 + len(partial.computed)
    assert (rebuilt.job_id, rebuilt.state, rebuilt.shards_done, rebuilt.samples_done) == ("job7", "running", 2, done)
    view = job_view(redis_client, KEYS, "job7")
    assert (view.samples_done, view.samples_failed, view.tokens_done) == (done, 1, sum(tokens.values()))
    assert view.shards == {"done": 2, "pending": 1}
    assert redis_client.smembers(KEYS.open("job7")) == {"2"}
    [error] = job_errors(redis_client, KEYS, "job7")
    assert (error.row, error.sample_id, error.kind) == (13, "no-assistant", "row")

    with pytest.raises(StoreError, match="still holds job job7"):
        rebuild_job(redis_client, KEYS, planned.spec.out)
    # A corrupted file is not counted: its shard goes back to pending when rebuilt again.
    first = min(store.records().values(), key=lambda r: r.index)
    (planned.spec.out / first.file).write_bytes(b"garbage")
    again = rebuild_job(redis_client, KEYS, planned.spec.out, replace=True)
    assert (again.shards_done, again.samples_done) == (1, done - 1)
    assert redis_client.smembers(KEYS.open("job7")) == {"0", "2"}


def test_rebuild_counts_a_regenerating_jobs_generation_as_its_workers_did(
    sglang_servers, tiny_llama, tmp_path, redis_client
) -> None:
    """Generated tokens and cut turns come back from the store (each done sample's regenerated row, its tokens as
    logged with it): the job's generation figures after a rebuild are those its run counted, not 0."""
    server = sglang_servers(tiny_llama, layers=DEFAULT_LAYERS["llama"])
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(12, seed=6))
    spec = JobSpec(model=tiny_llama, data=data, layers=DEFAULT_LAYERS["llama"], out=Path("job"), shard_size=5,
                   regenerate="all", max_new_tokens=12, temperature=0.0)  # fmt: skip
    planned = plan_job(spec, output_root=tmp_path / "outputs", job_id="regen")
    store = OutputStore.open_existing(planned.spec.out)
    plan = plan_run(planned.spec.extraction(), stored=store.manifest)
    make = sglang_engine_factory(planned.spec, RunSettings(server_url=server.url), job="regen",
                                 dump_root=server.dump_root, log_path=tmp_path / "unused.log")  # fmt: skip
    engine = make(plan.capture, plan.folder)
    run = Run(plan.on(engine), engine, store, target_for(store, None))
    reports = [run.rows(a, b) for a, b in ((0, 5), (5, 10))]
    engine.close()
    store.close()
    assert all(r.generated_tokens > 0 for r in reports) and sum(r.turns_cut for r in reports) > 0

    rebuild_job(redis_client, KEYS, planned.spec.out)
    view = job_view(redis_client, KEYS, "regen")
    assert (view.samples_done, view.shards) == (10, {"done": 2, "pending": 1})
    assert (view.generated_rows, view.generated_tokens, view.cut_turns) == (
        10,
        sum(r.generated_tokens for r in reports),
        sum(r.turns_cut for r in reports),
    )


def test_rebuild_refuses_a_folder_not_made_by_a_job(tmp_path, redis_client) -> None:
    with pytest.raises(StoreError, match=r"no job\.json"):
        rebuild_job(redis_client, KEYS, tmp_path)
