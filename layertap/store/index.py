"""The store's index: one JSON line per committed sample, appended by each writer to its own log.

Each process appends to ``index/<writer>.jsonl`` (fsync per line), so concurrent workers never share
a file handle or a lock. A torn last line (killed mid-append) is ignored; the sample it described
is simply not done and will be recomputed. A sample committed twice has two records; the store
keeps the one that describes its file (`OutputStore.records`).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from layertap.sample import TokenizedSample
from sglang_patch.sample_files import ids_sha256, mask_from_runs, mask_runs

INDEX_DIR = "index"
ERRORS_DIR = "errors"
# A regenerated run's rows, each logged before its index record: {"sample_id", "ids_sha256", "row", "generated_tokens"}.
REGENERATED_DIR = "regenerated"
RETIRED_DIR = "retired"  # samples taken out again: {"sample_id", "sha256"} of the record retired
# A stream-only run's puts: each sample's record (``file`` its object's handle) logged before it is put, so a resumed
# run finds the record of a sample a consumer acked after its producer died (`OutputStore.streamed`).
STREAMED_DIR = "streamed"


@dataclass(frozen=True, slots=True)
class SampleRecord:
    """What the store knows about a committed sample; verify and resume check the file against it.

    ``index`` is the dataset row number (0-based): the store's name, and its on-disk key, for what the pipeline
    calls ``row``. ``file`` is relative to the store root; ``sha256`` is of the file bytes; ``ids_sha256`` of
    ``input_ids`` as int64 little-endian; ``mask_runs`` the [start, end) runs where loss_mask == 1.
    """

    sample_id: str
    index: int
    num_tokens: int
    file: str
    nbytes: int
    sha256: str
    ids_sha256: str
    mask_runs: tuple[tuple[int, int], ...]
    truncated: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict) -> SampleRecord:
        return cls(**{**d, "mask_runs": tuple(tuple(r) for r in d["mask_runs"])})

    def describes(self, sample: TokenizedSample) -> bool:
        """Whether this record is of ``sample`` as its row tokenizes now: the same row, ``input_ids`` and loss mask."""
        return (
            self.index == sample.index
            and self.num_tokens == sample.num_tokens
            and self.ids_sha256 == ids_sha256(sample.input_ids)
            and self.mask_runs == mask_runs(sample.loss_mask)
        )

    def loss_mask(self) -> torch.Tensor:
        """The loss mask [T] uint8 rebuilt from its runs."""
        return mask_from_runs(self.mask_runs, self.num_tokens)


class JsonlLog:
    """An append-only, fsynced JSON-lines file owned by one writer."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def append(self, line: str, *, sync: bool = True) -> None:
        """One line, on disk before this returns unless ``sync`` is off (a line another record can stand in for)."""
        os.write(self._fd, line.encode() + b"\n")
        if sync:
            os.fsync(self._fd)

    def close(self) -> None:
        os.fsync(self._fd)
        os.close(self._fd)


def count_json_lines(path: Path) -> int:
    """How many records the JSONL file ``path`` holds, as written: one per ``\\n``. Never ``str.splitlines()``,
    which also splits at U+2028 / U+2029 and other line breaks that JSON text written with ``ensure_ascii=False``
    carries inside its strings."""
    return path.read_bytes().count(b"\n") if path.exists() else 0


def read_json_lines(path: Path) -> Iterator[dict]:
    """Every well-formed JSON object of the JSONL file ``path``, in line order, its lines split at ``\n`` alone (see
    `count_json_lines`)."""
    with open(path, "rb") as f:
        for line in f:  # a binary file's lines end at b"\n" only
            try:
                obj = json.loads(line)
            except ValueError:
                continue  # a torn append from a killed writer
            if isinstance(obj, dict):
                yield obj


def read_jsonl_dir(folder: Path) -> Iterator[dict]:
    """Every well-formed JSON object in ``folder/*.jsonl``, in file-name then line order."""
    if not folder.is_dir():
        return
    for path in sorted(folder.glob("*.jsonl")):
        yield from read_json_lines(path)


def load_index_candidates(root: Path) -> dict[str, list[SampleRecord]]:
    """sample_id -> every record of it (more than one only if it was committed again).

    Read through a per-process `IndexReader`, so a worker that runs many shards of one store parses
    each index line once, not once per shard.
    """
    folder = (Path(root) / INDEX_DIR).resolve()
    with _READERS_LOCK:
        reader = _READERS.pop(str(folder), None) or IndexReader(folder)
        _READERS[str(folder)] = reader  # most recently used last
        while len(_READERS) > _MAX_READERS:
            _READERS.pop(next(iter(_READERS)))
    return reader.candidates()


@dataclass(slots=True)
class _LogState:
    inode: int
    offset: int  # bytes parsed so far: always just after a newline
    records: list[SampleRecord]


class IndexReader:
    """Reads a store's index logs incrementally: each call parses only the lines appended since the last.

    Logs are append-only. A torn last line (no newline yet) is left for the next call; a log that was
    replaced (new inode) or shrank is read again from its start; a removed log is forgotten.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._logs: dict[str, _LogState] = {}
        self._lock = threading.Lock()

    def candidates(self) -> dict[str, list[SampleRecord]]:
        with self._lock:
            present = sorted(self.folder.glob("*.jsonl")) if self.folder.is_dir() else []
            for name in set(self._logs) - {p.name for p in present}:
                del self._logs[name]
            for path in present:
                self._catch_up(path)
            out: dict[str, list[SampleRecord]] = {}
            for name in sorted(self._logs):
                for rec in self._logs[name].records:
                    out.setdefault(rec.sample_id, []).append(rec)
            return out

    def _catch_up(self, path: Path) -> None:
        try:
            st = path.stat()
        except FileNotFoundError:
            self._logs.pop(path.name, None)
            return
        state = self._logs.get(path.name)
        if state is None or state.inode != st.st_ino or st.st_size < state.offset:
            state = self._logs[path.name] = _LogState(st.st_ino, 0, [])
        if st.st_size == state.offset:
            return
        with open(path, "rb") as f:
            f.seek(state.offset)
            data = f.read(st.st_size - state.offset)
        whole = data[: data.rfind(b"\n") + 1]
        state.offset += len(whole)
        for line in whole.split(b"\n")[:-1]:  # records end at \n alone (see count_json_lines)
            try:
                obj = json.loads(line)
                state.records.append(SampleRecord.from_dict(obj))
            except (ValueError, TypeError, KeyError):
                continue  # a line torn by a killed writer, completed by nothing


_MAX_READERS = 8
_READERS: dict[str, IndexReader] = {}
_READERS_LOCK = threading.Lock()
