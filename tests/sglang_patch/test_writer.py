"""The writer threads: atomic dumps, the host-memory cap, no overwrite, CPU staging."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from harness.processes import REPO_ROOT
from sglang_patch.contract import (
    AUX_FINAL_PRE,
    LOSS_MASK_PARAM,
    META_FILE,
    PLACE_PARAM,
    PLACED_MASK,
    SEGMENT_PREFIX,
    TMP_DIR,
    DumpError,
    Placement,
    dump_dir,
    format_rid,
    iter_dump_rids,
    read_dump,
)
from sglang_patch.sample_files import stack_aux_final
from sglang_patch.writer import DumpJob, DumpWriter, HostBudget, HostStaging, build_meta, write_dump


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
    writer = DumpWriter(tmp_path, layers=(1, 4), finals=("post",), budget=HostBudget(1 << 30), threads=2)
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


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in tensors.values())


def test_writer_waits_for_the_copy_event_and_the_cap_blocks_new_requests(tmp_path: Path) -> None:
    dumps = [states(5, i) for i in range(3)]
    size = nbytes(dumps[0])
    budget = HostBudget(2 * size)  # room for two dumps' buffers
    writer = DumpWriter(tmp_path, layers=(1, 4), finals=("post",), budget=budget, threads=2)
    events = [FakeCudaEvent() for _ in range(3)]
    rids = [format_rid("j", str(i), 0) for i in range(3)]
    for i in range(2):
        assert budget.reserve(size) == 0.0
        writer.submit(DumpJob(rids[i], tensors=dumps[i], ready=events[i], nbytes=size))
    third = threading.Thread(target=budget.reserve, args=(size,))  # the forward pass, for a third request
    third.start()
    time.sleep(0.3)
    # Both dumps wait for their copies to land; the cap is reached, so the forward pass blocks.
    assert events[0].waited and events[1].waited and not dump_dir(tmp_path, rids[0]).exists()
    assert third.is_alive() and budget.in_use == 2 * size
    events[0].release()
    wait_for(dump_dir(tmp_path, rids[0]))
    third.join(10)
    assert not third.is_alive() and budget.peak == 2 * size and budget.waited_s >= 0.25
    writer.submit(DumpJob(rids[2], tensors=dumps[2], ready=events[2], nbytes=size))
    events[1].release()
    events[2].release()
    writer.close(timeout=30)
    assert sorted(iter_dump_rids(tmp_path)) == sorted(rids) and budget.in_use == 0
    # The wait is reported once, with the dump queued after it; every dump says how busy the writers were.
    writers = [read_dump(dump_dir(tmp_path, rid)).meta.writer for rid in rids]
    assert [w["wait_s"] > 0.2 for w in writers] == [False, False, True]
    assert all(w["pinned_cap_bytes"] == 2 * size and w["threads"] == 2 and w["queued"] >= 1 for w in writers)


def test_cap_does_not_wait_when_no_dump_is_being_written() -> None:
    budget = HostBudget(100)
    budget.reserve(80)  # a request still being prefilled: only forward passes can finish it
    assert budget.reserve(80) == 0.0 and budget.in_use == 160  # waiting would deadlock
    budget.release(160, handed=False)
    assert budget.in_use == 0


def test_dump_records_its_writers_phases(tmp_path: Path) -> None:
    writer = DumpWriter(tmp_path, layers=(1, 4), finals=("post",), budget=HostBudget(1 << 30), threads=3)
    rids = [format_rid("j", str(i), 0) for i in range(12)]
    for i, rid in enumerate(rids):
        writer.submit(DumpJob(rid, tensors=states(3 + i, i)))
    writer.close(timeout=30)
    for i, rid in enumerate(rids):
        dump = read_dump(dump_dir(tmp_path, rid))
        assert torch.equal(dump.tensors["aux"], states(3 + i, i)["aux"])
        stats = dump.meta.writer
        assert stats is not None and stats["threads"] == 3
        assert stats["ready_s"] >= 0 and stats["write_s"] > 0  # CPU rows: nothing to wait for, bytes to write


def test_existing_dump_is_not_replaced(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rid = format_rid("j", "s", 0)
    first, second = states(4, 0), states(4, 1)
    write_dump(tmp_path, build_meta(rid, first, None, layers=(1, 4), finals=("post",)), first, tag="a")
    with pytest.raises(FileExistsError):
        write_dump(tmp_path, build_meta(rid, second, None, layers=(1, 4), finals=("post",)), second, tag="b")
    writer = DumpWriter(tmp_path, layers=(1, 4), finals=("post",), budget=HostBudget(1 << 30), threads=2)
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
    assert staging.record() is None and staging.footprint(1000) == 1000
    assert HostStaging(torch.device("cuda")).footprint(1000) == 1024  # torch's pinned blocks are powers of 2


def both_finals(t: int, seed: int) -> dict[str, torch.Tensor]:
    tensors = states(t, seed)
    tensors["final_pre"] = torch.randn(t, 8, generator=torch.Generator().manual_seed(seed + 100))
    return tensors


@pytest.mark.parametrize("layout", ["specforge", "speculators"])
def test_trainer_layouts_hold_what_the_store_would_write(tmp_path: Path, layout: str) -> None:
    from layertap.sample import CapturedSample, TokenizedSample
    from layertap.store.formats import get_format
    from sglang_patch.contract import SampleLayout

    writer = DumpWriter(
        tmp_path, layers=(1, 4), finals=("post", "pre"), budget=HostBudget(1 << 30), threads=2, layout=layout
    )
    rid, tensors = format_rid("j", "s", 0), both_finals(9, 3)
    runs = [[1, 4], [6, 9]]
    staged = tensors  # as the hook stages them: speculators' [T, k+1, H] already stacked on the device
    if layout == "speculators":
        stacked = torch.stack([*tensors["aux"].unbind(1), tensors["final_pre"]], dim=1)
        staged = {"input_ids": tensors["input_ids"], AUX_FINAL_PRE: stacked}
    writer.submit(DumpJob(rid, tensors=staged, params={LOSS_MASK_PARAM: runs}))
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
        fmt.write(captured, SampleLayout(layout, (1, 4), ("post", "pre"), "float32", 8), f)
    expected, got = fmt.load(store_file), fmt.load(dump.path / dump.meta.file)
    assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
    assert all(torch.equal(dump.tensors[k], expected[k]) for k in expected)


@pytest.mark.parametrize(
    ("runs", "reason"),
    [(None, "request carried none"), ([[2, 1]], "bad loss mask run"), ([[0, 99]], "bad loss mask run"), ("x", "list")],
)
def test_specforge_dump_without_a_usable_loss_mask_is_an_error_dump(tmp_path: Path, runs: object, reason: str) -> None:
    writer = DumpWriter(
        tmp_path, layers=(1, 4), finals=("post",), budget=HostBudget(1 << 30), threads=2, layout="specforge"
    )
    rid = format_rid("j", "s", 0)
    writer.submit(DumpJob(rid, tensors=states(5, 1), params={LOSS_MASK_PARAM: runs}))
    writer.close(timeout=30)
    meta = read_dump(dump_dir(tmp_path, rid)).meta
    assert meta.status == "error" and reason in meta.error


def test_a_dump_that_cannot_be_written_becomes_an_error_dump_at_once(tmp_path: Path) -> None:
    """A real write failure (the file size limit, as a full disk would fail the write): the client gets
    an error dump saying why, instead of waiting for a dump that never comes; nothing half-written stays."""
    code = f"""
import resource, signal, torch
from pathlib import Path
from sglang_patch.contract import format_rid
from sglang_patch.writer import DumpJob, DumpWriter, HostBudget
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
writer = DumpWriter(Path({str(tmp_path)!r}), layers=(1, 4), finals=("post",), budget=HostBudget(1 << 30), threads=2)
ids = torch.arange(512)
writer.submit(DumpJob(format_rid("j", "big", 0), tensors={{"input_ids": ids, "aux": torch.ones(512, 2, 256),
                                                           "final_post": torch.ones(512, 256)}}))
writer.close(timeout=30)
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "failed to write the dump" in done.stderr
    dump = read_dump(dump_dir(tmp_path, format_rid("j", "big", 0)))
    assert dump.meta.status == "error" and "could not write this capture" in (dump.meta.error or "")
    assert "File too large" in (dump.meta.error or "")
    assert list((tmp_path / TMP_DIR).iterdir()) == []


def test_fp8_speculators_dump_is_the_file_an_fp8_store_writes_and_needs_its_scales(tmp_path: Path) -> None:
    """The hook quantizes on the device (`quantize_fp8`); the dump is then byte for byte what the store writes from
    the same float32 capture (the HF engine's path), and a dump without its scales breaks the contract."""
    from layertap.sample import CapturedSample, TokenizedSample
    from layertap.store.formats import get_format
    from sglang_patch.contract import FP8_DTYPE, SCALES, DumpError, SampleLayout
    from sglang_patch.sample_files import quantize_fp8

    writer = DumpWriter(
        tmp_path, layers=(1, 4), finals=("pre",), budget=HostBudget(1 << 30), threads=1, layout="speculators"
    )
    rid, tensors = format_rid("j", "s", 0), both_finals(9, 5)
    fp8, scales = quantize_fp8(torch.stack([*tensors["aux"].unbind(1), tensors["final_pre"]], dim=1))
    writer.submit(DumpJob(rid, tensors={"input_ids": tensors["input_ids"], AUX_FINAL_PRE: fp8, SCALES: scales}))
    writer.close(timeout=30)
    dump = read_dump(dump_dir(tmp_path, rid))
    assert dump.meta.dtype == "float8_e4m3fn" and dump.tensors["hidden_states_scales"].shape == (9, 3, 1)
    captured = CapturedSample(
        TokenizedSample("s", 0, tensors["input_ids"], torch.ones(9, dtype=torch.uint8)), tensors["aux"], None,
        tensors["final_pre"],
    )  # fmt: skip
    store_file = tmp_path / "store-written"
    with store_file.open("wb") as f:
        get_format("speculators").write(captured, SampleLayout("speculators", (1, 4), ("pre",), FP8_DTYPE, 8), f)
    assert store_file.read_bytes() == (dump.path / dump.meta.file).read_bytes()

    rid = format_rid("j", "no-scales", 0)
    meta = build_meta(rid, {"input_ids": tensors["input_ids"], AUX_FINAL_PRE: fp8}, None, layers=(1, 4),
                      finals=("pre",), layout="speculators")  # fmt: skip
    write_dump(tmp_path, meta, {"input_ids": tensors["input_ids"], AUX_FINAL_PRE: fp8}, tag="t")
    with pytest.raises(DumpError, match="hidden_states_scales"):
        read_dump(dump_dir(tmp_path, rid))


def test_stack_aux_final_gives_back_the_tensor_its_inputs_are_views_of_and_copies_otherwise() -> None:
    """A speculators dump as read: aux and the pre-norm final are views of its ``hidden_states``; the stream puts that
    tensor as it is, not a copy of it. Any other inputs are concatenated."""
    states = torch.randn(5, 4, 8)
    aux, final = states[:, :3], states[:, 3]
    stacked = stack_aux_final(aux, final)
    assert stacked.data_ptr() == states.data_ptr() and torch.equal(stacked, states)
    for other_aux, other_final in ((aux.clone(), final), (aux, final.clone()), (states[:, :2], states[:, 3])):
        joined = stack_aux_final(other_aux, other_final)
        assert torch.equal(joined, torch.cat([other_aux, other_final.unsqueeze(1)], dim=1))
        assert joined.data_ptr() not in (states.data_ptr(), other_aux.data_ptr())


def placement(dump_root: Path, t: int, k: int, h: int, *, key: str = "obj", offset: int = 4096) -> Placement:
    """A placement of a float32 speculators sample of ``t`` tokens, ``k`` aux layers, width ``h`` in a fresh segment
    file of ``dump_root``, laid out as hs-connectors packs it (64-byte aligned, in name order)."""
    sizes = {"hidden_states": t * (k + 1) * h * 4, PLACED_MASK: t, "token_ids": t * 8}
    spans, at = {}, 0
    for name in sorted(sizes):
        spans[name], at = (at, sizes[name]), -(-(at + sizes[name]) // 64) * 64
    path = dump_root / f"{SEGMENT_PREFIX}test"
    path.write_bytes(b"\xff" * (offset + at + 4096))
    return Placement(key, str(path), offset, at, spans)


@pytest.mark.parametrize("file", [False, True])
def test_a_placed_speculators_sample_lands_at_its_spans_and_its_dump_holds_only_meta(
    tmp_path: Path, file: bool
) -> None:
    """With a placement among its custom params, the writer writes the sample into the client's segment file (gaps
    zeroed, nothing outside it touched) and the dump folder holds meta.json only, or its tensors file too when the
    placement asks for it; read back, its tensors are views of the placed bytes (of the file, where there is one),
    the loss mask built from the runs sent."""
    writer = DumpWriter(tmp_path, layers=(1, 4), finals=("pre",), budget=HostBudget(1 << 30), threads=1,
                        layout="speculators")  # fmt: skip
    rid, tensors = format_rid("j", "s", 0), both_finals(9, 5)
    stacked = torch.stack([*tensors["aux"].unbind(1), tensors["final_pre"]], dim=1)
    place = replace(placement(tmp_path, 9, 2, 8), file=file)
    before = Path(place.path).read_bytes()
    params = {LOSS_MASK_PARAM: [[2, 5], [7, 9]], PLACE_PARAM: place.param()}
    writer.submit(DumpJob(rid, tensors={"input_ids": tensors["input_ids"], AUX_FINAL_PRE: stacked}, params=params))
    writer.close(timeout=30)

    dump = read_dump(dump_dir(tmp_path, rid))
    files = sorted(p.name for p in dump.path.iterdir())
    assert files == sorted([META_FILE, *[dump.meta.file] * file]) and dump.meta.placed == place.param()
    assert (dump.data is not None) == file  # a file to commit by renaming it
    assert torch.equal(dump.tensors["hidden_states"], stacked)
    assert torch.equal(dump.tensors["token_ids"], tensors["input_ids"])
    assert dump.tensors[PLACED_MASK].tolist() == [0, 0, 1, 1, 1, 0, 0, 1, 1]
    after = Path(place.path).read_bytes()
    end = place.offset + place.size
    assert after[: place.offset] == before[: place.offset] and after[end:] == before[end:]
    gaps = [
        (s + n, e)
        for (s, n), (e, _) in zip(
            sorted(place.tensors.values()), [*sorted(place.tensors.values())[1:], (place.size, 0)], strict=True
        )
    ]
    assert all(after[place.offset + a : place.offset + b] == bytes(b - a) for a, b in gaps)


@pytest.mark.parametrize("why", ["misfit", "outside", "no-mask"])
def test_a_placement_the_server_may_not_write_is_an_error_dump_with_no_byte_written(tmp_path: Path, why: str) -> None:
    """A placement whose spans are not the sample's (a client that counted other tokens), one naming a file outside the
    dump root, or one sent without the loss mask it holds: an error dump saying why, the file untouched."""
    writer = DumpWriter(tmp_path, layers=(1, 4), finals=("pre",), budget=HostBudget(1 << 30), threads=1,
                        layout="speculators")  # fmt: skip
    tensors = both_finals(9, 5)
    stacked = torch.stack([*tensors["aux"].unbind(1), tensors["final_pre"]], dim=1)
    place = placement(tmp_path, 10 if why == "misfit" else 9, 2, 8)
    if why == "outside":
        outside = tmp_path / "elsewhere" / Path(place.path).name
        outside.parent.mkdir()
        outside.write_bytes(Path(place.path).read_bytes())
        place = Placement(place.key, str(outside), place.offset, place.size, place.tensors)
    before = Path(place.path).read_bytes()
    params = {PLACE_PARAM: place.param()} | ({} if why == "no-mask" else {LOSS_MASK_PARAM: [[0, 9]]})
    rid = format_rid("j", why, 0)
    writer.submit(DumpJob(rid, tensors={"input_ids": tensors["input_ids"], AUX_FINAL_PRE: stacked}, params=params))
    writer.close(timeout=30)
    meta = read_dump(dump_dir(tmp_path, rid)).meta
    said = {"misfit": "do not fit", "outside": "in this server's dump root", "no-mask": "carried none"}[why]
    assert meta.status == "error" and said in meta.error and Path(place.path).read_bytes() == before


def test_a_placement_param_is_checked_before_any_use() -> None:
    good = {"key": "k", "path": "/x/.segment-a", "offset": 0, "size": 128, "tensors": {"a": [0, 64], "b": [64, 64]}}
    assert Placement.from_param(good).tensors == {"a": (0, 64), "b": (64, 64)}
    for bad in ("x", {**good, "tensors": {"a": [0, 100], "b": [64, 64]}}, {**good, "size": 100},
                {**good, "offset": "far"}, {k: v for k, v in good.items() if k != "key"}):  # fmt: skip
        with pytest.raises(DumpError):
            Placement.from_param(bad)


def test_a_placed_dump_is_checked_where_it_was_placed_and_against_the_sample(tmp_path: Path) -> None:
    """Read back, a placed dump's token ids are hashed from the placed bytes (changed there: a DumpError), a placement
    whose file is gone is a DumpError, and the engine refuses one whose loss mask is not its sample's."""
    from layertap.engines.sglang.engine import captured_from_dump
    from layertap.errors import SampleError
    from layertap.sample import TokenizedSample
    from layertap.spec import CaptureSpec

    writer = DumpWriter(tmp_path, layers=(1, 4), finals=("pre",), budget=HostBudget(1 << 30), threads=1,
                        layout="speculators")  # fmt: skip
    tensors = both_finals(9, 5)
    stacked = torch.stack([*tensors["aux"].unbind(1), tensors["final_pre"]], dim=1)
    place = placement(tmp_path, 9, 2, 8)
    rid = format_rid("j", "s", 0)
    params = {LOSS_MASK_PARAM: [[2, 5]], PLACE_PARAM: place.param()}
    writer.submit(DumpJob(rid, tensors={"input_ids": tensors["input_ids"], AUX_FINAL_PRE: stacked}, params=params))
    writer.close(timeout=30)
    dump = read_dump(dump_dir(tmp_path, rid))
    spec = CaptureSpec(layers=(1, 4), final_post=False, final_pre=True, convention="capture", given_ids=(1, 4),
                       num_layers=6)  # fmt: skip
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 0, 0, 0], dtype=torch.uint8)
    captured = captured_from_dump(dump, TokenizedSample("s", 0, tensors["input_ids"], mask), spec)
    assert captured.placed == place.key and captured.source is None and torch.equal(captured.final_pre, stacked[:, 2])
    with pytest.raises(SampleError, match="loss mask"):
        captured_from_dump(dump, TokenizedSample("s", 0, tensors["input_ids"], torch.ones(9, dtype=torch.uint8)), spec)

    both = replace(place, file=True)  # the both target's: the file committed by a rename, the object announced
    rid = format_rid("j", "s", 1)
    writer = DumpWriter(tmp_path, layers=(1, 4), finals=("pre",), budget=HostBudget(1 << 30), threads=1,
                        layout="speculators")  # fmt: skip
    writer.submit(DumpJob(rid, tensors={"input_ids": tensors["input_ids"], AUX_FINAL_PRE: stacked},
                          params={**params, PLACE_PARAM: both.param()}))  # fmt: skip
    writer.close(timeout=30)
    captured = captured_from_dump(read_dump(dump_dir(tmp_path, rid)), TokenizedSample("s", 0, tensors["input_ids"],
                                                                                      mask), spec)  # fmt: skip
    assert captured.placed == place.key and captured.source is not None and captured.source.path.parent.exists()
    assert torch.equal(captured.final_pre, stacked[:, 2])

    ids_at = place.offset + place.tensors["token_ids"][0]
    with open(place.path, "r+b") as f:
        f.seek(ids_at)
        f.write((int(tensors["input_ids"][0]) + 1).to_bytes(8, "little"))
    with pytest.raises(DumpError, match="input_ids hash"):
        read_dump(dump_dir(tmp_path, rid))
    Path(place.path).unlink()
    with pytest.raises(DumpError, match="cannot be read"):
        read_dump(dump_dir(tmp_path, rid))


def test_placed_samples_written_side_by_side_into_one_segment_land_and_its_mapping_goes_with_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writer threads store placed samples into one shared mapping of the segment file at once (a pwrite each would
    queue on the file's lock), each at its own spans; once the producer removes the file, an idle writer unmaps it
    (tmpfs would keep its pages while mapped)."""
    monkeypatch.setattr("sglang_patch.writer.SWEEP_S", 0.05)
    writer = DumpWriter(tmp_path, layers=(1, 4), finals=("pre",), budget=HostBudget(1 << 30), threads=4,
                        layout="speculators")  # fmt: skip
    one = placement(tmp_path, 9, 2, 8)
    step = -(-one.size // 4096) * 4096
    Path(one.path).write_bytes(b"\xff" * (step * 8 + 4096))
    samples = {}
    for n in range(8):
        rid, tensors = format_rid("j", f"s{n}", 0), both_finals(9, n)
        stacked = torch.stack([*tensors["aux"].unbind(1), tensors["final_pre"]], dim=1)
        place = Placement(f"obj{n}", one.path, step * n + 64 * (n % 2), one.size, one.tensors)
        params = {LOSS_MASK_PARAM: [[0, n + 1]], PLACE_PARAM: place.param()}
        writer.submit(DumpJob(rid, tensors={"input_ids": tensors["input_ids"], AUX_FINAL_PRE: stacked}, params=params))
        samples[rid] = (stacked, tensors["input_ids"], n + 1)
    for rid, (stacked, ids, masked) in samples.items():
        wait_for(dump_dir(tmp_path, rid))
        dump = read_dump(dump_dir(tmp_path, rid))
        assert torch.equal(dump.tensors["hidden_states"], stacked) and torch.equal(dump.tensors["token_ids"], ids)
        assert dump.tensors[PLACED_MASK].sum() == masked
    del dump  # its tensors are views of the file, read here

    def mapped() -> bool:
        return any(one.path in line for line in Path("/proc/self/maps").read_text().splitlines())

    assert mapped()
    Path(one.path).unlink()
    deadline = time.monotonic() + 10
    while mapped():
        assert time.monotonic() < deadline, "the removed segment file is still mapped"
        time.sleep(0.02)
    writer.close(timeout=30)
