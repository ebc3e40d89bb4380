"""The writer thread: atomic dumps, backpressure, no overwrite, CPU staging."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from sglang_patch.contract import TMP_DIR, dump_dir, format_rid, iter_dump_rids, read_dump
from sglang_patch.writer import DumpJob, DumpWriter, HostStaging, build_meta, write_dump


class FakeCudaEvent:
    """Stands in for the CUDA event of a D2H copy (no GPU here): `synchronize` waits until released."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.waited = False

    def release(self) -> None:
        self._done.set()

    def synchronize(self) -> None:
        self.waited = True
        assert self._done.wait(30)


def states(t: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 100, (t,), generator=g),
        "aux": torch.randn(t, 2, 8, generator=g),
        "final_post": torch.randn(t, 8, generator=g),
    }


def wait_for(path: Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.01)


def test_writer_writes_dumps_and_error_dumps(tmp_path: Path) -> None:
    writer = DumpWriter(tmp_path, layers=(1, 4), finals=("post",), max_pending=4)
    ok, bad = format_rid("j", "ok", 0), format_rid("j", "bad", 0)
    tensors = states(7, 0)
    writer.submit(DumpJob(ok, tensors=tensors))
    writer.submit(DumpJob(bad, error="prefix-cache hit"))
    writer.close(timeout=30)
    assert sorted(iter_dump_rids(tmp_path)) == sorted([ok, bad])
    dump = read_dump(dump_dir(tmp_path, ok))
    assert dump.meta.layers == (1, 4) and dump.meta.finals == ("post",)
    assert all(torch.equal(dump.tensors[n], tensors[n]) for n in tensors)
    assert read_dump(dump_dir(tmp_path, bad)).meta.error == "prefix-cache hit"
    assert list((tmp_path / TMP_DIR).iterdir()) == []


def test_writer_waits_for_the_copy_event_and_applies_backpressure(tmp_path: Path) -> None:
    writer = DumpWriter(tmp_path, layers=(1, 4), finals=("post",), max_pending=1)
    events = [FakeCudaEvent() for _ in range(3)]
    rids = [format_rid("j", str(i), 0) for i in range(3)]
    writer.submit(DumpJob(rids[0], tensors=states(5, 0), ready=events[0]))
    writer.submit(DumpJob(rids[1], tensors=states(5, 1), ready=events[1]))  # fills the queue
    third = threading.Thread(target=writer.submit, args=(DumpJob(rids[2], tensors=states(5, 2), ready=events[2]),))
    third.start()
    time.sleep(0.3)
    # The first dump waits for its copies to land; the queue is full, so the forward pass blocks.
    assert events[0].waited and not dump_dir(tmp_path, rids[0]).exists()
    assert third.is_alive()
    events[0].release()
    wait_for(dump_dir(tmp_path, rids[0]))
    third.join(10)
    assert not third.is_alive()
    events[1].release()
    events[2].release()
    writer.close(timeout=30)
    assert sorted(iter_dump_rids(tmp_path)) == sorted(rids)


def test_existing_dump_is_not_replaced(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rid = format_rid("j", "s", 0)
    first, second = states(4, 0), states(4, 1)
    write_dump(tmp_path, build_meta(rid, first, None, layers=(1, 4), finals=("post",)), first, tag="a")
    with pytest.raises(FileExistsError):
        write_dump(tmp_path, build_meta(rid, second, None, layers=(1, 4), finals=("post",)), second, tag="b")
    writer = DumpWriter(tmp_path, layers=(1, 4), finals=("post",), max_pending=2)
    writer.submit(DumpJob(rid, tensors=second))
    writer.submit(DumpJob(format_rid("j", "after", 0), tensors=second))
    writer.close(timeout=30)
    assert "failed to write the dump" in caplog.text
    assert torch.equal(read_dump(dump_dir(tmp_path, rid)).tensors["aux"], first["aux"])
    assert dump_dir(tmp_path, format_rid("j", "after", 0)).exists()  # the thread kept going
    assert list((tmp_path / TMP_DIR).iterdir()) == []


def test_cpu_staging_is_plain_memory_without_events() -> None:
    staging = HostStaging(torch.device("cpu"))
    buffer = staging.alloc((3, 4), torch.bfloat16)
    assert buffer.shape == (3, 4) and buffer.dtype == torch.bfloat16 and not buffer.is_pinned()
    assert staging.record() is None


def both_finals(t: int, seed: int) -> dict[str, torch.Tensor]:
    tensors = states(t, seed)
    tensors["final_pre"] = torch.randn(t, 8, generator=torch.Generator().manual_seed(seed + 100))
    return tensors


@pytest.mark.parametrize("layout", ["specforge", "speculators"])
def test_trainer_layouts_hold_what_the_store_would_write(tmp_path: Path, layout: str) -> None:
    from layertap.sample import CapturedSample, TokenizedSample
    from layertap.store.formats import get_format
    from layertap.store.formats.base import Layout

    writer = DumpWriter(tmp_path, layers=(1, 4), finals=("post", "pre"), max_pending=2, layout=layout)
    rid, tensors = format_rid("j", "s", 0), both_finals(9, 3)
    runs = [[1, 4], [6, 9]]
    writer.submit(DumpJob(rid, tensors=tensors, loss_mask_runs=runs))
    writer.close(timeout=30)
    dump = read_dump(dump_dir(tmp_path, rid))
    assert dump.meta.layout == layout and (dump.path / dump.meta.file).is_file()
    # The store's own writer, from the same capture, must produce exactly these tensors.
    fmt = get_format(layout)
    mask = torch.tensor([0, 1, 1, 1, 0, 0, 1, 1, 1], dtype=torch.uint8)
    captured = CapturedSample(
        TokenizedSample("s", 0, tensors["input_ids"], mask), tensors["aux"], tensors["final_post"], tensors["final_pre"]
    )
    store_file = tmp_path / "store-written"
    with store_file.open("wb") as f:
        fmt.write(captured, Layout(num_aux=2, hidden_size=8, dtype=torch.float32), f)
    expected, got = fmt.load(store_file), fmt.load(dump.path / dump.meta.file)
    assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
    assert all(torch.equal(dump.tensors[k], expected[k]) for k in expected)


@pytest.mark.parametrize(
    ("runs", "reason"),
    [(None, "request carried none"), ([[2, 1]], "bad loss mask run"), ([[0, 99]], "bad loss mask run"), ("x", "list")],
)
def test_specforge_dump_without_a_usable_loss_mask_is_an_error_dump(tmp_path: Path, runs: object, reason: str) -> None:
    writer = DumpWriter(tmp_path, layers=(1, 4), finals=("post",), max_pending=2, layout="specforge")
    rid = format_rid("j", "s", 0)
    writer.submit(DumpJob(rid, tensors=states(5, 1), loss_mask_runs=runs))
    writer.close(timeout=30)
    meta = read_dump(dump_dir(tmp_path, rid)).meta
    assert meta.status == "error" and reason in meta.error
