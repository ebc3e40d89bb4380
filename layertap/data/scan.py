"""One streaming pass over a dataset before any work is planned: count rows, collect ids, find duplicates.

Sample ids name state records and index entries, so two rows with one id would overwrite each other's
captures or be skipped as "already done" on resume. The first row with an id keeps it; every later
row with the same id becomes a per-row error naming the first's row, and the run goes on. Shards
read only their own rows, so the scan (which sees every id) records the duplicates in the output
folder (``DUPLICATES_FILE``) before any shard runs, and every shard reads them from there.
"""

from __future__ import annotations

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
    """``sample_ids[i]`` is row i's id, None for a row that cannot be read or has an unusable id;
    ``duplicates`` maps each row whose id an earlier row has to that earlier (first) row."""

    path: Path
    num_rows: int
    sample_ids: list[str | None]
    unreadable_rows: list[int]
    duplicates: dict[int, int] = field(default_factory=dict)


def scan_dataset(path: Path) -> DatasetScan:
    """Stream the dataset once (columnar formats read only the id columns) and find repeated ids.

    Raises DatasetError when the dataset cannot be read or has no rows; nothing about one row stops it.
    """
    ids: list[str | None] = []
    unreadable: list[int] = []
    first_row: dict[str, int] = {}
    duplicates: dict[int, int] = {}
    for number, row in iter_rows(path, columns=ID_FIELDS):
        sid = None
        if isinstance(row, RowError):
            unreadable.append(number)
        else:
            with suppress(RowError):  # an unusable id: reported when the row is processed
                sid = sample_id_of(number, row)
        ids.append(sid)
        if sid is not None:
            first = first_row.setdefault(sid, number)
            if first != number:
                duplicates[number] = first
    if not ids:
        raise DatasetError(f"dataset {path} has no rows")
    return DatasetScan(Path(path), len(ids), ids, unreadable, duplicates)


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
