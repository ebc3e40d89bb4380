"""Committing a sample file the SGLang plugin already wrote in the store's format: a rename on one
filesystem (no bytes copied), one copy across filesystems, refused when it disagrees with the sample."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from layertap.engines.sglang import captured_from_dump
from layertap.errors import SampleError
from layertap.sample import CapturedSample, TokenizedSample
from layertap.spec import resolve_capture
from layertap.store.manifest import Manifest
from layertap.store.store import OutputStore
from layertap.verify import verify_store
from sglang_patch.contract import (
    AUX,
    AUX_FINAL_PRE,
    FINAL_TENSORS,
    FORMAT_FINAL,
    INPUT_IDS,
    SPECULATORS,
    format_rid,
    read_dump,
)
from sglang_patch.sample_files import stack_aux_final
from sglang_patch.writer import build_meta, write_dump

H, K, T = 16, 2, 11
LAYERS = (1, 2)


def _store(root: Path, fmt: str, store_dtype: str = "float32") -> OutputStore:
    final = FORMAT_FINAL[fmt]
    manifest = Manifest(
        format=fmt, model_path="m", model_config_sha256="-", model_revision=None, tokenizer_sha256="-",
        chat_template_sha256=None, compute_dtype="float32", store_dtype=store_dtype, hidden_size=H, num_layers=4,
        layer_ids_given=[1, 2], layer_convention="capture", capture_indices=[1, 2], final_post_norm=final == "post",
        final_pre_norm=final == "pre", max_length=None, overlong="truncate", dataset_path="d", dataset_rows=3,
        engine={"name": "sglang"},
    )  # fmt: skip
    return OutputStore.create_or_resume(root, manifest)


def _sample(index: int = 0) -> TokenizedSample:
    g = torch.Generator().manual_seed(index)
    mask = (torch.arange(T) % 3 == 0).to(torch.uint8)
    return TokenizedSample(f"s{index}", index, torch.randint(4, 500, (T,), generator=g), mask)


def _server_file(
    dump_root: Path, fmt: str, sample: TokenizedSample, *, mask: torch.Tensor | None = None
) -> CapturedSample:
    """A dump as the plugin writes it (its own writer), and the capture the SGLang engine makes of it."""
    g = torch.Generator().manual_seed(100 + sample.index)
    aux, final = torch.randn(T, K, H, generator=g), torch.randn(T, H, generator=g)
    captured = {INPUT_IDS: sample.input_ids, AUX: aux, FINAL_TENSORS[FORMAT_FINAL[fmt]]: final}
    if fmt == SPECULATORS:  # the hook stages speculators' [T, k+1, H] already stacked
        captured = {INPUT_IDS: sample.input_ids, AUX_FINAL_PRE: stack_aux_final(aux, final)}
    rid = format_rid("job", sample.sample_id, 0)
    finals = (FORMAT_FINAL[fmt],)
    meta = build_meta(rid, captured, None, layers=LAYERS, finals=finals, layout=fmt)
    loss_mask = (sample.loss_mask if mask is None else mask).to(torch.long)
    path = write_dump(dump_root, meta, captured, tag="t", loss_mask=loss_mask)
    spec = resolve_capture(list(LAYERS), convention="capture", num_layers=4, final=finals[0])
    return captured_from_dump(read_dump(path), sample, spec)


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A folder on /dev/shm (tmpfs): another filesystem than the test's tmp_path."""
    path = Path(tempfile.mkdtemp(prefix="layertap-adopt-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_same_filesystem_commit_is_a_rename(tmp_path: Path, fmt: str) -> None:
    store = _store(tmp_path / "out", fmt)
    captured = _server_file(tmp_path / "dumps", fmt, _sample())
    inode = captured.source.path.stat().st_ino
    record = store.commit(captured)
    dest = tmp_path / "out" / record.file
    assert dest.stat().st_ino == inode and not captured.source.path.exists()  # moved, not rewritten
    store.close()
    assert verify_store(tmp_path / "out").ok


def test_other_filesystem_commit_copies_once(tmp_path: Path, shm_dir: Path) -> None:
    assert os.stat(shm_dir).st_dev != os.stat(tmp_path).st_dev, "/dev/shm is not another filesystem here"
    store = _store(tmp_path / "out", "specforge")
    captured = _server_file(shm_dir, "specforge", _sample())
    original = captured.source.path.read_bytes()
    record = store.commit(captured)
    assert (tmp_path / "out" / record.file).read_bytes() == original and not captured.source.path.exists()
    assert not list((tmp_path / "out").rglob(".tmp-*"))
    store.close()
    assert verify_store(tmp_path / "out").ok


def test_a_file_that_disagrees_with_the_sample_is_refused(tmp_path: Path) -> None:
    store = _store(tmp_path / "out", "specforge")
    sample = _sample()
    wrong_mask = 1 - sample.loss_mask
    captured = _server_file(tmp_path / "dumps", "specforge", sample, mask=wrong_mask)
    with pytest.raises(SampleError, match="loss_mask differs"):
        store.commit(captured)
    assert store.records() == {} and not list((tmp_path / "out").rglob("data_*.ckpt"))


def test_another_store_dtype_is_written_not_moved(tmp_path: Path) -> None:
    store = _store(tmp_path / "out", "specforge", store_dtype="bfloat16")
    captured = _server_file(tmp_path / "dumps", "specforge", _sample())
    record = store.commit(captured)
    assert captured.source.path.exists()  # left for the engine to release
    assert store.format.load(tmp_path / "out" / record.file)["hidden_state"].dtype == torch.bfloat16
    store.close()
    assert verify_store(tmp_path / "out").ok


def test_the_index_records_the_sha256_of_the_adopted_file(tmp_path: Path) -> None:
    import hashlib

    store = _store(tmp_path / "out", "specforge")
    good = _server_file(tmp_path / "dumps", "specforge", _sample(0))
    digest = hashlib.sha256(good.source.path.read_bytes()).hexdigest()
    record = store.commit(good)
    assert record.sha256 == digest == hashlib.sha256((tmp_path / "out" / record.file).read_bytes()).hexdigest()
    store.close()
    assert verify_store(tmp_path / "out", level="full").ok
    assert verify_store(tmp_path / "out").ok
