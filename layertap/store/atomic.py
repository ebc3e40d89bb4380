"""Durable writes: a file is either complete under its final name or absent.

Every sample file goes temp name -> fsync -> rename -> fsync of the folder, so a crash (SIGKILL, power
loss, full disk) can leave only a temp file, never a truncated file under a final name.
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from sglang_patch.writer import fsync_path

TMP_MARK = ".tmp-"


@dataclass(frozen=True, slots=True)
class WrittenFile:
    """Size and sha256 of a file as it was written (hashed on the way out, not re-read)."""

    nbytes: int
    sha256: str


class _HashingWriter:
    """A write-only file wrapper that hashes and counts bytes as they pass."""

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self._hash = hashlib.sha256()
        self.nbytes = 0

    def write(self, data: bytes | memoryview) -> int:
        self._hash.update(data)
        self.nbytes += len(data)
        return self._raw.write(data)

    def flush(self) -> None:
        self._raw.flush()

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def temp_path_for(dest: Path) -> Path:
    """A unique temp name next to ``dest`` (same filesystem, so the rename is atomic)."""
    return dest.with_name(f"{TMP_MARK}{dest.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")


def atomic_write(dest: Path, write: Callable[[IO[bytes]], None]) -> WrittenFile:
    """Write ``dest`` through ``write(fileobj)`` atomically; return its size and sha256."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path_for(dest)
    try:
        with open(tmp, "wb") as raw:
            hashing = _HashingWriter(raw)
            write(hashing)  # type: ignore[arg-type]
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(dest.parent)
    return WrittenFile(nbytes=hashing.nbytes, sha256=hashing.hexdigest())


def move_into_place(src: Path, dest: Path, data: mmap.mmap) -> WrittenFile:
    """Move a complete, fsynced file to ``dest`` atomically; return its size and sha256, taken from ``data``, the
    file's bytes as its reader mapped them (so the file is not read again).

    On one filesystem this is a rename (no bytes copied). Across filesystems ``data`` is written once through
    `atomic_write` (hashed on the way) and the source is removed.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(src, dest)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        written = atomic_write(dest, lambda out: out.write(data))
        src.unlink()
        return written
    fsync_path(dest.parent)
    return WrittenFile(nbytes=len(data), sha256=hashlib.sha256(data).hexdigest())


def atomic_write_json(dest: Path, obj: Any) -> WrittenFile:
    """Atomically write a small JSON document."""
    data = json.dumps(obj, indent=2, sort_keys=True, default=str).encode() + b"\n"
    return atomic_write(dest, lambda f: f.write(data))


def sha256_file(path: Path) -> str:
    """sha256 of a file's bytes, hashed straight from a memory map (no copy into Python buffers;
    hashlib releases the GIL, so commit threads hash in parallel)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return hashlib.sha256().hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            return hashlib.sha256(view).hexdigest()
