"""A committed sample's file is hashed once and read back at most once on its way into the store (a dump is mapped,
not read: specforge's twice, by the hash and by torch).

Watched from the kernel (inotify: every open of the file, by Python, torch's C++ or safetensors' Rust readers) and
at the hash (every sha256 that ends on the file's digest), for the two ways in: a file the store writes from an HF
engine's capture, and a file the SGLang plugin already wrote in the store's format (its own writer), which the
engine reads and the store adopts.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from layertap.engines.sglang import captured_from_dump
from layertap.sample import TokenizedSample
from layertap.spec import resolve_capture
from layertap.store.manifest import Manifest
from layertap.store.store import OutputStore
from layertap.verify import verify_store
from sglang_patch.contract import AUX, AUX_FINAL_PRE, FINAL_TENSORS, INPUT_IDS, SPECULATORS, format_rid, read_dump
from sglang_patch.sample_files import stack_aux_final
from sglang_patch.writer import build_meta, write_dump
from tests.hf_engines import hf_engine

LAYERS, NUM_LAYERS, HIDDEN = (2, 4), 6, 64  # the tiny Llama's
FINAL = {"specforge": "post", "speculators": "pre"}
IN_ACCESS, IN_OPEN = 0x1, 0x20
_EVENT = struct.Struct("iIII")


class Inotify:
    """The kernel's open and read events on watched files, or on the files of watched folders (by name)."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_NONBLOCK)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())

    def watch(self, path: Path) -> None:
        assert self._libc.inotify_add_watch(self.fd, os.fsencode(path), IN_OPEN | IN_ACCESS) >= 0

    def events(self) -> list[tuple[int, str]]:
        """(mask, name) of every event since the last call; the name is empty for a watched file itself."""
        out = []
        while True:
            try:
                buf = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return out
            at = 0
            while at < len(buf):
                _, mask, _, size = _EVENT.unpack_from(buf, at)
                name = buf[at + _EVENT.size : at + _EVENT.size + size].rstrip(b"\0").decode()
                out.append((mask, name))
                at += _EVENT.size + size

    def close(self) -> None:
        os.close(self.fd)


@pytest.fixture
def inotify() -> Iterator[Inotify]:
    watcher = Inotify()
    yield watcher
    watcher.close()


@pytest.fixture
def digests(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every sha256 digest taken while the test runs (hashlib's own sha256, its results noted)."""
    taken: list[str] = []
    real = hashlib.sha256

    class Noted:
        def __init__(self, data: bytes = b"", **kw: bool) -> None:
            self._h = real(data, **kw)

        def update(self, data: bytes) -> None:
            self._h.update(data)

        def hexdigest(self) -> str:
            taken.append(self._h.hexdigest())
            return taken[-1]

    monkeypatch.setattr(hashlib, "sha256", Noted)
    return taken


def _store(root: Path, fmt: str) -> OutputStore:
    manifest = Manifest(
        format=fmt, model_path="m", model_config_sha256="-", model_revision=None, tokenizer_sha256="-",
        chat_template_sha256=None, compute_dtype="float32", store_dtype="float32", hidden_size=HIDDEN,
        num_layers=NUM_LAYERS, layer_ids_given=list(LAYERS), layer_convention="capture", capture_indices=list(LAYERS),
        final_post_norm=FINAL[fmt] == "post", final_pre_norm=FINAL[fmt] == "pre", max_length=None,
        overlong="truncate", dataset_path="d", dataset_rows=2, engine={"name": "test"},
    )  # fmt: skip
    return OutputStore.create_or_resume(root, manifest)


def _samples() -> list[TokenizedSample]:
    g = torch.Generator().manual_seed(3)
    mask = (torch.arange(13) % 4 != 0).to(torch.uint8)
    return [TokenizedSample(f"s{i}", i, torch.randint(4, 500, (13,), generator=g), mask) for i in range(2)]


def _file_sha256(path: Path) -> str:
    return hashlib.new("sha256", path.read_bytes()).hexdigest()  # not hashlib.sha256: not one of the store's


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_a_written_sample_is_hashed_as_written_and_never_read_back(
    tmp_path: Path, fmt: str, tiny_llama: Path, inotify: Inotify, digests: list[str]
) -> None:
    spec = resolve_capture(list(LAYERS), convention="capture", num_layers=NUM_LAYERS, final=FINAL[fmt])
    first, second = hf_engine(tiny_llama, spec).capture(_samples())
    store = _store(tmp_path / "out", fmt)
    store.commit(first)  # makes the folder the second sample goes into
    folder = (tmp_path / "out" / store.format.relpath(1)).parent
    inotify.watch(folder)
    digests.clear()

    record = store.commit(second)

    name = Path(record.file).name
    mine = [(mask, n) for mask, n in inotify.events() if n == name or n.startswith(f".tmp-{name}.")]
    opens = [n for mask, n in mine if mask & IN_OPEN]
    assert len(opens) == 1 and opens[0].startswith(".tmp-"), f"opened as {opens}: once, to be written"
    assert not [n for mask, n in mine if mask & IN_ACCESS], "read back"
    assert digests.count(_file_sha256(tmp_path / "out" / record.file)) == 1 == digests.count(record.sha256)
    store.close()
    assert verify_store(tmp_path / "out", level="full").ok


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_a_dumped_sample_is_read_once_and_hashed_once_on_its_way_into_the_store(
    tmp_path: Path, fmt: str, inotify: Inotify, digests: list[str]
) -> None:
    sample = _samples()[0]
    g = torch.Generator().manual_seed(5)
    aux, final = torch.randn(13, len(LAYERS), HIDDEN, generator=g), torch.randn(13, HIDDEN, generator=g)
    captured = {INPUT_IDS: sample.input_ids, AUX: aux, FINAL_TENSORS[FINAL[fmt]]: final}
    if fmt == SPECULATORS:  # the hook stages speculators' [T, k+1, H] already stacked
        captured = {INPUT_IDS: sample.input_ids, AUX_FINAL_PRE: stack_aux_final(aux, final)}
    meta = build_meta(format_rid("j", sample.sample_id, 0), captured, None, layers=LAYERS, finals=(FINAL[fmt],),
                      layout=fmt)  # fmt: skip
    dump = write_dump(tmp_path / "dumps", meta, captured, tag="t", loss_mask=sample.loss_mask.to(torch.long))
    file = dump / meta.file
    expected, inode = _file_sha256(file), file.stat().st_ino
    store = _store(tmp_path / "out", fmt)
    inotify.watch(file)  # the file itself: its events follow it into the store
    digests.clear()

    spec = resolve_capture(list(LAYERS), convention="capture", num_layers=NUM_LAYERS, final=FINAL[fmt])
    record = store.commit(captured_from_dump(read_dump(dump), sample, spec))

    assert (tmp_path / "out" / record.file).stat().st_ino == inode and record.sha256 == expected  # renamed
    opens = [mask for mask, _ in inotify.events() if mask & IN_OPEN]
    # Mapped, never read into memory: once for the hash, and specforge's zip once more by torch for its tensors (read
    # through a Python file object it was copied out with the GIL held, ~65 ms a 30 MB dump on an H200 host).
    maps = 2 if fmt == "specforge" else 1
    assert len(opens) <= maps, f"the dump's file was opened {len(opens)} times on its way into the store"
    assert digests.count(expected) == 1, f"the dump's file was hashed {digests.count(expected)} times"
    store.close()
    assert verify_store(tmp_path / "out", level="full").ok
