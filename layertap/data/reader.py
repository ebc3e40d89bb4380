"""Stream dataset rows from JSONL, JSON arrays, Parquet and `datasets.save_to_disk` folders.

Rows come one at a time (never the whole corpus in memory): a 37K-sample corpus with long
conversations is several GB of text. A row that cannot be read (a malformed JSON line, an array
item that is not an object) is yielded as a ``RowError`` so the run records it and goes on; a file
that cannot be read at all raises ``DatasetError``.

Row numbers are 0-based positions among the dataset's rows (blank JSONL lines are not rows); output
files and sample ids fall back to them, so every reader numbers rows the same way.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import pyarrow.parquet as pq

from layertap.errors import DatasetError, RowError

Row = dict[str, Any]
RowItem = tuple[int, Row | RowError]

_BATCH_ROWS = 256
_SUFFIXES = ".jsonl, .jsonl.gz, .json, .json.gz, .parquet, or a datasets.save_to_disk folder"


def iter_rows(
    path: Path,
    *,
    start: int = 0,
    stop: int | None = None,
    columns: Sequence[str] | None = None,
) -> Iterator[RowItem]:
    """Yield ``(row_number, row dict or RowError)`` for rows ``start <= row_number < stop``.

    ``start``/``stop`` let a shard read only its rows: Parquet skips whole row groups, Arrow folders
    slice, JSONL skips lines without parsing them; a JSON array has to be parsed up to ``start``.
    ``columns`` narrows columnar formats (Parquet, Arrow) to the named columns that exist, so a
    pre-scan that needs only ids does not read conversations; JSON rows always come whole.
    Raises DatasetError when the path is missing, unreadable or of an unknown format.
    """
    path = Path(path)
    try:  # exists() raises on a name too long for the filesystem
        if not path.exists():
            raise DatasetError(f"dataset not found: {path}")
        if stop is not None and stop <= start:
            return
        if path.is_dir():
            yield from _iter_arrow_folder(path, start, stop, columns)
            return
        name = path.name.lower()
        if name.endswith((".jsonl", ".jsonl.gz")):
            yield from _iter_jsonl(path, start, stop)
        elif name.endswith((".json", ".json.gz")):
            yield from _iter_json(path, start, stop)
        elif name.endswith(".parquet"):
            yield from _iter_parquet(path, start, stop, columns)
        else:
            raise DatasetError(f"unknown dataset format for {path}: expected {_SUFFIXES}")
    except (OSError, EOFError, zlib.error) as exc:  # unreadable, or a damaged/truncated gzip stream
        raise DatasetError(f"cannot read dataset {path}: {type(exc).__name__}: {exc}") from exc


def _open(path: Path) -> IO[bytes]:
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else path.open("rb")


def _as_row(number: int, value: Any, where: str) -> RowItem:
    if isinstance(value, dict):
        return number, value
    return number, RowError(f"{where} is not a JSON object (got {type(value).__name__})", row=number)


# Where rows start in plain JSONL files, learned while lines are skipped: a worker runs many shards
# of one dataset, and seeks to the last checkpoint before each shard's first row instead of reading
# the file from the top every time (gzip cannot seek, so .jsonl.gz is always read from the top).
# Keyed by path, size and mtime, so a changed file starts over. At most rows / CHECKPOINT_ROWS each.
CHECKPOINT_ROWS = 1024
_jsonl_checkpoints: dict[tuple[str, int, int], dict[int, tuple[int, int]]] = {}


def _checkpoints(path: Path) -> dict[int, tuple[int, int]]:
    """row number -> (byte offset of its line, lines before it), for a plain JSONL file."""
    if path.name.lower().endswith(".gz"):
        return {}
    st = path.stat()
    return _jsonl_checkpoints.setdefault((str(path.resolve()), st.st_size, st.st_mtime_ns), {})


def _iter_jsonl(path: Path, start: int, stop: int | None) -> Iterator[RowItem]:
    marks = _checkpoints(path)
    number, (offset, line_no) = max(((row, mark) for row, mark in marks.items() if row <= start), default=(0, (0, 0)))
    with _open(path) as f:
        f.seek(offset)
        for line in f:
            line_no += 1
            offset += len(line)
            if not line.strip():
                continue
            if stop is not None and number >= stop:
                return
            if number % CHECKPOINT_ROWS == 0:
                marks[number] = (offset - len(line), line_no - 1)
            if number >= start:
                try:
                    value = json.loads(line)
                except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than json can parse
                    yield number, RowError(f"line {line_no}: malformed JSON: {exc}", row=number)
                else:
                    yield _as_row(number, value, f"line {line_no}")
            number += 1


def _first_byte(f: IO[bytes]) -> bytes:
    """The first non-whitespace byte (after a UTF-8 BOM), leaving ``f`` positioned at the start."""
    head = f.read(4096)
    while head and not head.lstrip(b"\xef\xbb\xbf \t\r\n"):
        more = f.read(4096)
        if not more:
            break
        head += more
    f.seek(0)
    stripped = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    return stripped[:1]


def _looks_like_jsonl(f: IO[bytes]) -> bool:
    """True when the first line is a whole JSON value: ``datasets.to_json`` writes JSONL as ``.json``."""
    first = f.readline()
    f.seek(0)
    try:
        json.loads(first)
    except ValueError:
        return False
    return True


def _iter_json(path: Path, start: int, stop: int | None) -> Iterator[RowItem]:
    with _open(path) as f:
        first = _first_byte(f)
        if first == b"{" and _looks_like_jsonl(f):
            yield from _iter_jsonl(path, start, stop)
            return
        if first != b"[":
            raise DatasetError(
                f"{path} is not a JSON array of rows (it starts with {first.decode(errors='replace')!r}); "
                "expected '[{...}, ...]' or one JSON object per line"
            )
        number = 0
        try:
            for raw in _array_items(f):
                if stop is not None and number >= stop:
                    return
                if number >= start:
                    try:
                        value = json.loads(raw)
                    except (ValueError, RecursionError) as exc:
                        yield number, RowError(f"array item {number}: malformed JSON: {exc}", row=number)
                    else:
                        yield _as_row(number, value, f"array item {number}")
                number += 1
        except _UnclosedArray as exc:
            raise DatasetError(f"{path} is malformed JSON after {number} rows: {exc}") from exc


class _UnclosedArray(Exception):
    pass


# Outside strings: what changes the nesting or ends an item. Inside: what ends the string or escapes.
_STRUCTURE = re.compile(rb'["\[\]{},]')
_IN_STRING = re.compile(rb'["\\]')
_CHUNK = 1 << 20


def _array_items(f: IO[bytes]) -> Iterator[bytes]:
    """The raw bytes of each item of the JSON array ``f`` holds (``f`` at its start), split at the
    array's own commas, so each item is parsed alone: an item with NaN, a lone-surrogate escape,
    bytes that are not UTF-8 or nesting too deep to parse is one bad row, not an unreadable file.
    (A streaming parser would stop at the first such item, or silently turn a surrogate into "?".)
    Raises _UnclosedArray when the file ends inside the array."""
    opened, depth, in_string, escaped = False, 0, False, False
    item = bytearray()
    while chunk := f.read(_CHUNK):
        i, n = 0, len(chunk)
        if escaped:  # the previous chunk ended with a backslash inside a string
            item += chunk[:1]
            i, escaped = 1, False
        while i < n:
            if in_string:
                m = _IN_STRING.search(chunk, i)
                j = n if m is None else m.start()
                item += chunk[i : j + 1]
                if m is not None and chunk[j] == ord("\\"):
                    if j + 1 < n:
                        item += chunk[j + 1 : j + 2]
                    escaped = j + 1 >= n
                    j += 1
                elif m is not None:
                    in_string = False
                i = j + 1
                continue
            m = _STRUCTURE.search(chunk, i)
            if m is None:
                item += chunk[i:] if opened else b""
                break
            j, c = m.start(), chunk[m.start() : m.start() + 1]
            if not opened:  # the caller checked that the first byte is "["
                opened, i = True, j + 1
                continue
            item += chunk[i:j]
            i = j + 1
            if c == b'"':
                in_string = True
                item += c
            elif c in b"[{":
                depth += 1
                item += c
            elif depth > 0 and c in b"]}":
                depth -= 1
                item += c
            elif depth > 0 or c not in b",]":  # a comma inside an item, or a stray "}" (bad item JSON)
                item += c
            else:  # an item ends at the array's comma or its closing bracket
                if c == b"," or item.strip():
                    yield bytes(item)
                item = bytearray()
                if c == b"]":
                    return
    raise _UnclosedArray("the file ends inside the array (truncated?)")


def _iter_table_rows(batches: Iterator[Any], first_number: int, start: int, stop: int | None) -> Iterator[RowItem]:
    number = first_number
    for batch in batches:
        for row in batch.to_pylist():
            if stop is not None and number >= stop:
                return
            if number >= start:
                yield number, row
            number += 1


def _iter_parquet(path: Path, start: int, stop: int | None, columns: Sequence[str] | None) -> Iterator[RowItem]:
    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid and friends for a non-Parquet file
        raise DatasetError(f"{path} is not a readable Parquet file: {exc}") from exc
    names = pf.schema_arrow.names
    cols = None if columns is None else [c for c in columns if c in names]
    # Skip whole row groups that end before `start`.
    groups: list[int] = []
    first_number = 0
    offset = 0
    for i in range(pf.num_row_groups):
        n = pf.metadata.row_group(i).num_rows
        if offset + n > start and (stop is None or offset < stop):
            if not groups:
                first_number = offset
            groups.append(i)
        offset += n
    if not groups:
        return
    batches = pf.iter_batches(batch_size=_BATCH_ROWS, row_groups=groups, columns=cols)
    yield from _iter_table_rows(batches, first_number, start, stop)


def _iter_arrow_folder(path: Path, start: int, stop: int | None, columns: Sequence[str] | None) -> Iterator[RowItem]:
    import datasets  # heavy import, only for this format

    if not ((path / "state.json").exists() or (path / "dataset_dict.json").exists()):
        raise DatasetError(
            f"{path} is a folder but not one written by datasets.save_to_disk (no state.json or "
            f"dataset_dict.json); expected {_SUFFIXES}"
        )
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises several unrelated types for a damaged folder
        raise DatasetError(f"cannot load {path} with datasets.load_from_disk: {exc}") from exc
    if isinstance(ds, datasets.DatasetDict):
        if len(ds) != 1:
            raise DatasetError(
                f"{path} holds splits {sorted(ds)}; pass one split's folder, e.g. {path / next(iter(ds))}"
            )
        ds = next(iter(ds.values()))
    end = len(ds) if stop is None else min(stop, len(ds))
    if columns is not None:
        wanted = [c for c in columns if c in ds.column_names]
        if not wanted:  # a table without columns has no rows either, but the rows still exist
            yield from ((n, {}) for n in range(start, end))
            return
        ds = ds.select_columns(wanted)
    # Memory-mapped: a slice maps pages of the Arrow file, it does not load the dataset.
    table = ds.with_format("arrow")
    for lo in range(start, end, _BATCH_ROWS):
        hi = min(lo + _BATCH_ROWS, end)
        yield from _iter_table_rows(iter([table[lo:hi]]), lo, lo, hi)
