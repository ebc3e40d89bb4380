"""A sample that makes the engine fail is retried alone and recorded after N attempts; its batch-mates
and the rest of the shard are committed (`Run.rows`, what every worker runs)."""

from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from layertap.engines.base import Engine
from layertap.engines.hf import HFEngine
from layertap.errors import ServerError
from layertap.pipeline import Run, plan_run, target_for
from layertap.sample import CapturedSample, TokenizedSample
from layertap.spec import ExtractionSpec
from layertap.state.model import JobSpec
from layertap.state.plan import plan_job
from layertap.store.store import OutputStore
from tests.core.datasets import conversation_rows, write_jsonl
from tests.hf_engines import hf_engine


class PoisonedEngine(Engine):
    """The real HF engine, except that it raises when a poisoned sample comes out, with the rest of its
    batch still held, as an SGLang server answering one request with an error would (no server here)."""

    def __init__(self, inner: HFEngine, poison: set[str], error: type[Exception] = RuntimeError) -> None:
        self.inner, self.spec, self.poison, self.error = inner, inner.spec, poison, error
        self.compute_dtype = inner.compute_dtype
        self.raised: Counter[str] = Counter()

    def capture(self, samples: Iterable[TokenizedSample]) -> Iterator[CapturedSample]:
        for cap in self.inner.capture(samples):
            if cap.sample.sample_id in self.poison:
                self.raised[cap.sample.sample_id] += 1
                raise self.error(f"server answered 500 for {cap.sample.sample_id}")
            yield cap

    def describe(self) -> dict:
        return self.inner.describe()


@pytest.fixture
def store(tiny_llama: Path, tmp_path: Path) -> tuple[ExtractionSpec, OutputStore]:
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(30, seed=6))
    planned = plan_job(JobSpec(model=tiny_llama, data=data, layers=(2, 3, 4)), output_root=tmp_path / "o", job_id="j")
    return planned.spec.extraction(), OutputStore.open_existing(planned.spec.out)


def test_poison_samples_fail_alone_after_n_attempts_and_the_rest_is_committed(store, tiny_llama) -> None:
    spec, out = store
    engine = PoisonedEngine(hf_engine(tiny_llama, spec.resolve(6), batch_size=8), {"conv-7", "conv-20"})
    report = Run(plan_run(spec, stored=out.manifest).on(engine), engine, out, target_for(out, None)).rows()

    assert report.failed == 2 and len(report.computed) == 28 and not report.stopped
    assert set(out.records()) == {f"conv-{i}" for i in range(30)} - {"conv-7", "conv-20"}
    # Raised once inside a batch (no attempt counted: its batch-mates were suspects too), then 3 times alone.
    assert engine.raised == {"conv-7": 4, "conv-20": 4}
    errors = {e["sample_id"]: e for e in out.errors()}
    assert set(errors) == {"conv-7", "conv-20"}
    for e in errors.values():
        assert e["kind"] == "capture" and "RuntimeError: server answered 500" in e["reason"]
        assert "failed all 3 attempts" in e["reason"]


def test_a_server_error_is_not_blamed_on_samples_but_fails_the_shard(store, tiny_llama) -> None:
    spec, out = store
    engine = PoisonedEngine(hf_engine(tiny_llama, spec.resolve(6), batch_size=8), {"conv-3"}, error=ServerError)
    with pytest.raises(ServerError, match="conv-3"):
        Run(plan_run(spec, stored=out.manifest).on(engine), engine, out, target_for(out, None)).rows()
    assert out.errors() == [] and engine.raised == {"conv-3": 1}
