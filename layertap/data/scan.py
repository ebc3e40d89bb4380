"""One streaming pass over a dataset before any work is planned: count rows, find duplicate ids, hash its bytes.

Sample ids name state records and index entries, so two rows with one id would overwrite each other's
captures or be skipped as "already done" on resume. The first row with an id keeps it; every later
row with the same id becomes a per-row error naming the first's row, and the run goes on. Shards
read only their own rows, so the scan (which sees every id) records the duplicates in the output
folder (``DUPLICATES_FILE``) before any shard runs, and every shard reads them from there.

The content hash (`dataset_sha256`) names the dataset in the manifest by what it holds, not by its path
and row count: a dataset regenerated with as many rows (a new system prompt, edited turns) hashes apart.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from layertap.data.reader import iter_rows
from layertap.data.rows import ID_FIELDS, sample_id_of
from layertap.errors import DatasetError, RowError
from layertap.store.atomic import atomic_write_json

DUPLICATES_FILE = "duplicate_ids.json"


@dataclass(frozen=True, slots=True)
class DatasetScan:
    """What the planner needs and nothing more (a 37K-row scan keeps no per-row list): the row count, and
    ``duplicates``, each row whose id an earlier row has mapped to that earlier (first) row. Unreadable rows
    and unusable ids are counted as rows and reported when their shard processes them. ``sha256`` is
    `dataset_sha256` of its files."""

    path: Path
    num_rows: int
    sha256: str
    duplicates: dict[int, int] = field(default_factory=dict)


def scan_dataset(path: Path) -> DatasetScan:
    """Stream the dataset once (columnar formats read only the id columns) and find repeated ids.

    Raises DatasetError when the dataset cannot be read or has no rows; nothing about one row stops it.
    """
    first_row: dict[str, int] = {}  # the one per-id table duplicates need; dropped when the scan returns
    duplicates: dict[int, int] = {}
    num_rows = 0
    for number, row in iter_rows(path, columns=ID_FIELDS):
        num_rows += 1
        if isinstance(row, RowError):
            continue
        with suppress(RowError):  # an unusable id: reported when the row is processed
            first = first_row.setdefault(sample_id_of(number, row), number)
            if first != number:
                duplicates[number] = first
    if not num_rows:
        raise DatasetError(f"dataset {path} has no rows")
    return DatasetScan(Path(path), num_rows, dataset_sha256(Path(path)), duplicates)


def dataset_sha256(path: Path, chunk: int = 8 << 20) -> str:
    """sha256 of the dataset's bytes, streamed in ``chunk``-byte reads: the file, or for a ``save_to_disk``
    folder each file's relative name and bytes in name order (measured: benchmarks/results/dataset_hash.md)."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    digest = hashlib.sha256()
    for file in files:
        if file != path:
            digest.update(file.relative_to(path).as_posix().encode() + b"\0")
        with file.open("rb") as f:
            while block := f.read(chunk):
                digest.update(block)
    return digest.hexdigest()


def save_duplicates(out: Path, scan: DatasetScan) -> None:
    """Record the scan's duplicate rows in the output folder ``out`` (atomically), for every shard to read."""
    atomic_write_json(out / DUPLICATES_FILE, {"duplicates": {str(k): v for k, v in scan.duplicates.items()}})


def load_duplicates(out: Path) -> dict[int, int]:
    """Row -> first row with its id, as ``save_duplicates`` recorded it in ``out`` (empty if it did not)."""
    try:
        doc = json.loads((out / DUPLICATES_FILE).read_text())
    except FileNotFoundError:
        return {}
    return {int(k): int(v) for k, v in doc["duplicates"].items()}
