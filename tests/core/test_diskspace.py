"""The disk estimate against real stores, and free space against the filesystem's own numbers."""

import os

import pytest

from layertap.diskspace import bytes_per_token, free_bytes
from layertap.models.folder import model_dims
from layertap.pipeline import plan_run, run_extraction
from layertap.spec import ExtractionSpec
from layertap.store.store import OutputStore
from tests.core.datasets import conversation_rows, write_jsonl
from tests.hf_engines import cpu_hf


@pytest.mark.parametrize(
    ("fmt", "final", "dtype"),
    [("specforge", "post", "bfloat16"), ("speculators", "pre", "float32"), ("speculators", "pre", "fp8")],
)
def test_bytes_per_token_matches_what_the_store_writes(tiny_llama, tmp_path, fmt, final, dtype) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(12, seed=3))
    spec = ExtractionSpec(model=tiny_llama, data=data, layers=[1, 3, 5], format=fmt, final=final, store_dtype=dtype)
    run_extraction(spec, tmp_path / "out", cpu_hf(batch_tokens=4096))
    records = OutputStore.open_existing(tmp_path / "out").records().values()
    tokens = sum(r.num_tokens for r in records)
    files = {
        (st.st_dev, st.st_ino): st.st_size for f in (tmp_path / "out").rglob("*") if (st := f.stat()) and f.is_file()
    }
    written = sum(files.values())  # a hard link (speculators' hidden_states/ beside samples/) takes no more space

    plan = plan_run(spec)  # the estimate the coordinator checks: the plan's bytes per token (`plan_job`)
    assert (plan.capture, plan.folder.hidden_size) == (spec.resolve(model_dims(tiny_llama)[0]), 64)
    estimate = tokens * bytes_per_token(plan.capture, plan.folder.hidden_size, dtype)
    # The folder holds the estimated tensors plus, per sample, a file header and an index line, and a
    # few fixed files (manifest, report, the Arrow table's metadata): a few KiB per sample at most.
    assert estimate <= written <= estimate + len(records) * 4096 + (64 << 10), (written, estimate)


def test_free_bytes_is_what_statvfs_gives_an_unprivileged_writer(tmp_path) -> None:
    st = os.statvfs(tmp_path)
    assert abs(free_bytes(tmp_path) - st.f_bavail * st.f_frsize) < 64 << 20
    # A folder that does not exist yet is measured on its nearest existing parent.
    assert abs(free_bytes(tmp_path / "not" / "yet") - free_bytes(tmp_path)) < 64 << 20
