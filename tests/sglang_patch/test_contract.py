"""The dump contract: rid grammar, dump folder names, meta.json and read_dump's checks."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from sglang_patch.contract import (
    META_FILE,
    STATES_FILE,
    DumpError,
    RequestId,
    dump_dir,
    format_rid,
    iter_dump_rids,
    parse_rid,
    read_dump,
    rid_matches,
    sweep_stale_dumps,
    temp_dir,
)
from sglang_patch.sample_files import ids_sha256
from sglang_patch.writer import build_meta, write_dump

AWKWARD_IDS = ["plain", "a:b", "::", "50%", "%3A", "x/y/../z", "", "naïve 漢字", "tab\there", "hscap:j:s:0"]


@pytest.mark.parametrize("sample", AWKWARD_IDS)
@pytest.mark.parametrize("job", ["job-1", "j:o:b"])
def test_rid_round_trip(job: str, sample: str) -> None:
    rid = format_rid(job, sample, 3, prefix="hs:cap")
    assert rid.count(":") == 3
    assert parse_rid(rid) == RequestId(prefix="hs:cap", job=job, sample=sample, attempt=3)
    assert rid_matches(rid, "hs:cap")
    assert not rid_matches(rid, "hs")


def test_distinct_parts_give_distinct_rids() -> None:
    # Without quoting, ("a:b", "c") and ("a", "b:c") would collide.
    assert format_rid("a:b", "c", 0) != format_rid("a", "b:c", 0)
    assert format_rid("j", "s", 1) != format_rid("j", "s", 10)


@pytest.mark.parametrize(
    "bad",
    ["hscap:j:s", "hscap:j:s:0:1", "hscap:j:s:x", "hscap:j:s:-1", "hscap:j:%61:0", ":j:s:0"],
)
def test_parse_rid_rejects(bad: str) -> None:
    with pytest.raises(DumpError):
        parse_rid(bad)


@pytest.mark.parametrize("other", [None, "4687d4f7a1b24c1d", "HEALTH_CHECK_1795938259.08", "hscapx:j:s:0", "hscap"])
def test_foreign_rids_do_not_match(other: str | None) -> None:
    assert not rid_matches(other, "hscap")


def test_overlong_rid_is_refused() -> None:
    with pytest.raises(DumpError, match="too long"):
        format_rid("job", "x" * 300, 0)


def test_input_ids_hash_is_int64_little_endian() -> None:
    ids = torch.tensor([0, 1, 2**40, 163839, 7], dtype=torch.int64)
    expected = hashlib.sha256(ids.numpy().astype("<i8").tobytes()).hexdigest()
    assert ids_sha256(ids) == expected


def _states(t: int = 12, k: int = 3, h: int = 16, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(t)
    return {
        "input_ids": torch.randint(0, 5000, (t,), generator=g),
        "aux": torch.randn(t, k, h, generator=g).to(dtype),
        "final_post": torch.randn(t, h, generator=g).to(dtype),
        "final_pre": torch.randn(t, h, generator=g).to(dtype),
    }


def _write(root: Path, rid: str, tensors: dict[str, torch.Tensor]) -> Path:
    meta = build_meta(rid, tensors, None, layers=(1, 3, 5), finals=("post", "pre"))
    return write_dump(root, meta, tensors, tag="t")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dump_round_trip(tmp_path: Path, dtype: torch.dtype) -> None:
    rid = format_rid("job", "a:b/c", 0)
    tensors = _states(dtype=dtype)
    path = _write(tmp_path, rid, tensors)
    assert path == dump_dir(tmp_path, rid)
    assert list(iter_dump_rids(tmp_path)) == [rid]
    dump = read_dump(path)
    assert dump.meta.rid == rid and dump.meta.status == "ok"
    assert dump.meta.num_tokens == 12 and dump.meta.hidden_size == 16 and dump.meta.layers == (1, 3, 5)
    assert dump.meta.dtype == str(dtype).removeprefix("torch.")
    assert dump.meta.input_ids_sha256 == ids_sha256(tensors["input_ids"])
    assert dump.tensors is not None
    for name, value in tensors.items():
        assert torch.equal(dump.tensors[name], value), name


def test_read_dump_catches_a_meta_that_disagrees(tmp_path: Path) -> None:
    path = _write(tmp_path, format_rid("job", "s", 0), _states())
    meta = json.loads((path / META_FILE).read_text())
    (path / META_FILE).write_text(json.dumps({**meta, "num_tokens": 11}))
    with pytest.raises(DumpError, match="do not match"):
        read_dump(path)


def test_read_dump_catches_changed_token_ids(tmp_path: Path) -> None:
    tensors = _states()
    path = _write(tmp_path, format_rid("job", "s", 0), tensors)
    data = bytearray((path / STATES_FILE).read_bytes())
    first_id = tensors["input_ids"][0].item().to_bytes(8, "little")
    offset = data.index(first_id, 8 + int.from_bytes(data[:8], "little"))
    data[offset] ^= 1
    (path / STATES_FILE).write_bytes(bytes(data))
    with pytest.raises(DumpError, match="hash"):
        read_dump(path, load_tensors=False)


@pytest.mark.parametrize("layout", ["states", "specforge"])
def test_a_truncated_dump_file_is_a_dump_error_not_a_crash(tmp_path: Path, layout: str) -> None:
    """A file cut short (a server killed mid-write past its rename cannot do it; a disk can): refused by the
    contract, as the engine's one check, instead of an exception from a tensor reader."""
    tensors = _states()
    rid = format_rid("job", "s", 0)
    finals = ("post",) if layout == "specforge" else ("post", "pre")
    meta = build_meta(rid, tensors, None, layers=(1, 3, 5), finals=finals, layout=layout)
    path = write_dump(tmp_path, meta, tensors, tag="t", loss_mask=torch.ones(12, dtype=torch.long))
    file = path / meta.file
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(DumpError, match="unreadable"):
        read_dump(path)


def test_read_dump_catches_a_misplaced_folder(tmp_path: Path) -> None:
    path = _write(tmp_path, format_rid("job", "s", 0), _states())
    moved = path.rename(tmp_path / "renamed")
    with pytest.raises(DumpError, match="is for rid"):
        read_dump(moved)


def test_error_dump(tmp_path: Path) -> None:
    rid = format_rid("job", "s", 2)
    meta = build_meta(rid, None, "prefix-cache hit at 36", layers=(1,), finals=("post",))
    path = write_dump(tmp_path, meta, None, tag="t")
    assert not (path / STATES_FILE).exists()
    dump = read_dump(path)
    assert dump.meta.status == "error" and dump.meta.error == "prefix-cache hit at 36" and dump.tensors is None


def test_only_stale_dumps_and_temp_folders_are_swept(tmp_path: Path) -> None:
    import os
    import time

    old, fresh = format_rid("j", "old", 0), format_rid("j", "fresh", 0)
    for rid in (old, fresh):
        _write(tmp_path, rid, _states(3))
    killed_mid_write = temp_dir(tmp_path, format_rid("j", "torn", 0), "99-0")
    killed_mid_write.mkdir(parents=True)
    two_hours_ago = time.time() - 7200
    for path in (dump_dir(tmp_path, old), killed_mid_write):
        os.utime(path, (two_hours_ago, two_hours_ago))
    assert sweep_stale_dumps(tmp_path, max_age_s=3600) == 2
    assert list(iter_dump_rids(tmp_path)) == [fresh] and not killed_mid_write.exists()
    assert sweep_stale_dumps(tmp_path, max_age_s=3600) == 0
