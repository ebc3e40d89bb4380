"""Planning at submit time: every check runs before anything exists, then one store and its shards."""

import json
from pathlib import Path

import pytest

from layertap.data.scan import load_duplicates
from layertap.errors import DatasetError, SpecError, StoreError
from layertap.state.model import JOB_FILE, JobSpec
from layertap.state.plan import job_of_store, plan_job
from layertap.store.manifest import read_manifest
from tests.core.datasets import conversation_rows, write_jsonl


@pytest.fixture
def data(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "data.jsonl", conversation_rows(23, seed=3))


def test_plan_creates_the_store_and_job_file_and_cuts_shards(tiny_llama, data, tmp_path) -> None:
    root = tmp_path / "outputs"
    spec = JobSpec(model=tiny_llama, data=data, layers=(1, 3, 5), out=Path("runs/a"), shard_size=10)
    planned = plan_job(spec, output_root=root, job_id="job1")

    out = (root / "runs" / "a").resolve()
    assert planned.spec.out == out and planned.shards == [(0, 10), (10, 20), (20, 23)]
    manifest = read_manifest(out)
    assert (manifest.dataset_rows, manifest.capture_indices, manifest.compute_dtype) == (23, [1, 3, 5], "float32")
    assert manifest.complete is False
    assert job_of_store(out) == ("job1", planned.spec)
    # The default folder is the job id under the root.
    default = plan_job(spec.model_copy(update={"out": None}), output_root=root, job_id="job2")
    assert default.spec.out == (root / "job2").resolve()


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"out": Path("../elsewhere")}, SpecError, "outside the output root"),
        ({"out": Path("/etc/x")}, SpecError, "outside the output root"),
        ({"out": Path(".")}, SpecError, "outside the output root"),
        ({"layers": (1, 6)}, SpecError, "outside [1, 5]"),
        ({"model": Path("relative/model")}, SpecError, "model must be an absolute path"),
        ({"data": Path("data.jsonl")}, SpecError, "data must be an absolute path"),
        ({"model": Path("/nonexistent/model")}, SpecError, "no config.json"),
        ({"data": Path("/nonexistent/data.jsonl")}, DatasetError, "dataset not found"),
    ],
)
def test_bad_specs_are_refused_before_anything_is_written(tiny_llama, data, tmp_path, change, error, message) -> None:
    root = tmp_path / "outputs"
    spec = JobSpec(model=tiny_llama, data=data, layers=(1, 3, 5), out=Path("a")).model_copy(update=change)
    with pytest.raises(error, match=message.replace("[", r"\[")):
        plan_job(spec, output_root=root, job_id="job1")
    assert not root.exists()


def test_duplicate_ids_are_recorded_for_the_shards_and_unreadable_datasets_are_refused(tiny_llama, tmp_path) -> None:
    rows = conversation_rows(5)
    rows[4]["id"] = rows[0]["id"]
    dup = write_jsonl(tmp_path / "dup.jsonl", rows)
    spec = JobSpec(model=tiny_llama, data=dup, layers=(1, 2, 3), shard_size=2)
    planned = plan_job(spec, output_root=tmp_path / "dups", job_id="d")
    assert planned.shards == [(0, 2), (2, 4), (4, 5)]
    assert load_duplicates(tmp_path / "dups" / "d") == {4: 0}  # the last shard never reads row 0
    garbage = tmp_path / "garbage.json"
    garbage.write_text("this is not json")
    with pytest.raises(DatasetError, match="not a JSON array"):
        plan_job(JobSpec(model=tiny_llama, data=garbage, layers=(1, 2, 3)), output_root=tmp_path / "o", job_id="j")
    assert not (tmp_path / "o").exists()


def test_an_output_folder_of_another_job_or_run_is_refused(tiny_llama, data, tmp_path) -> None:
    root = tmp_path / "outputs"
    spec = JobSpec(model=tiny_llama, data=data, layers=(1, 3, 5), out=Path("a"))
    plan_job(spec, output_root=root, job_id="first")
    with pytest.raises(StoreError, match="already belongs to job first"):
        plan_job(spec, output_root=root, job_id="second")

    (root / "b").mkdir(parents=True)
    (root / "b" / "notes.txt").write_text("someone's files")
    with pytest.raises(StoreError, match="not empty"):
        plan_job(spec.model_copy(update={"out": Path("b")}), output_root=root, job_id="third")

    # A store from another run (other layers) without job.json: check_compatible refuses it.
    plan_job(spec.model_copy(update={"out": Path("c")}), output_root=root, job_id="fourth")
    (root / "c" / JOB_FILE).unlink()
    with pytest.raises(StoreError, match="different run"):
        plan_job(spec.model_copy(update={"out": Path("c"), "layers": (2, 3, 4)}), output_root=root, job_id="fifth")
    assert json.loads((root / "c" / "manifest.json").read_text())["capture_indices"] == [1, 3, 5]
