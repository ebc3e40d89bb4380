"""One streaming pass over a dataset before any work is planned: count rows, collect ids, refuse duplicates.

Sample ids name output files and state records, so two rows with one id would overwrite each other's
captures or be skipped as "already done" on resume; that must stop the job before it starts.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from layertap.data.reader import iter_rows
from layertap.data.rows import ID_FIELDS, sample_id_of
from layertap.errors import DatasetError, RowError

_SHOW_DUPLICATES = 5


@dataclass(frozen=True, slots=True)
class DatasetScan:
    """``sample_ids[i]`` is row i's id; ``unreadable_rows`` are rows that failed to read (id = row number)."""

    path: Path
    num_rows: int
    sample_ids: list[str]
    unreadable_rows: list[int]


def scan_dataset(path: Path) -> DatasetScan:
    """Stream the dataset once (columnar formats read only the id columns) and check its ids.

    Raises DatasetError when the dataset cannot be read, has no rows, or repeats an id (the first
    few duplicates are named, with the total count).
    """
    ids: list[str] = []
    unreadable: list[int] = []
    for number, row in iter_rows(path, columns=ID_FIELDS):
        if isinstance(row, RowError):
            unreadable.append(number)
            ids.append(str(number))
        else:
            ids.append(sample_id_of(number, row))
    if not ids:
        raise DatasetError(f"dataset {path} has no rows")
    if len(set(ids)) != len(ids):
        dups = [(sid, n) for sid, n in Counter(ids).items() if n > 1]
        shown = ", ".join(f"{sid!r} (x{n})" for sid, n in dups[:_SHOW_DUPLICATES])
        more = f" and {len(dups) - _SHOW_DUPLICATES} more" if len(dups) > _SHOW_DUPLICATES else ""
        raise DatasetError(
            f"dataset {path} has {len(dups)} duplicate sample ids: {shown}{more}; ids name output files, "
            "so each must be unique (fix the 'id'/'conversation_id' fields, or drop them to use row numbers)"
        )
    return DatasetScan(Path(path), len(ids), ids, unreadable)
