"""``token_freq.pt``: how often each token id occurs among the loss-masked tokens of the stored samples.

speculators builds its draft vocabulary from this file (``<data-path>/token_freq.pt``, a ``torch.save``
of a ``{token id: count}`` dict of Python ints, read with ``weights_only=True``); without it, it trains
on the whole target vocabulary. The counts are taken as samples are committed, never by a second pass
over the states: each writer appends one line per committed sample to ``token_freq/<writer>.jsonl``
(before the sample's index record, so every record has its line), and ``finalize`` sums, over the
store's records, the line of each sample (one per sample id and token ids, so a sample committed twice,
by a resumed run or by two workers, counts once). A record with no line (a store written before this
file existed) is counted from its file. ``layertap verify`` recounts everything from the files.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open

from layertap.sample import TokenizedSample
from layertap.store.atomic import atomic_write
from layertap.store.index import SampleRecord, read_jsonl_dir
from layertap.trainers import TOKEN_FREQ_FILE

TOKEN_FREQ_DIR = "token_freq"


def masked_counts(input_ids: torch.Tensor, loss_mask: torch.Tensor) -> Counter[int]:
    """Occurrences of each token id where ``loss_mask`` [T] is 1, over ``input_ids`` [T]."""
    ids, counts = input_ids[loss_mask.to(torch.bool)].unique(return_counts=True)
    return Counter(dict(zip(ids.tolist(), counts.tolist(), strict=True)))


def count_line(sample: TokenizedSample, ids_sha256: str) -> str:
    """The log line of one committed sample: its masked token counts, keyed by sample id and token-id hash."""
    counts = masked_counts(sample.input_ids, sample.loss_mask)
    doc = {"sample_id": sample.sample_id, "ids_sha256": ids_sha256, "ids": list(counts), "n": list(counts.values())}
    return json.dumps(doc, separators=(",", ":"))


def stored_ids(path: Path, key: str) -> torch.Tensor:
    """The token ids [T] of a stored sample file, read without loading its hidden states."""
    if path.suffix == ".safetensors":
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(key)
    return torch.load(path, mmap=True, weights_only=True, map_location="cpu")[key]


def recount(root: Path, records: Iterable[SampleRecord], ids_key: str) -> Counter[int]:
    """Counts taken again from the stored files' token ids and the records' loss masks."""
    total: Counter[int] = Counter()
    for rec in records:
        total.update(masked_counts(stored_ids(root / rec.file, ids_key), rec.loss_mask()))
    return total


def committed_counts(root: Path, records: Iterable[SampleRecord], ids_key: str) -> Counter[int]:
    """Counts over ``records`` from the writers' logs (each sample once); records without a line are recounted."""
    logged = {(d["sample_id"], d["ids_sha256"]): d for d in read_jsonl_dir(root / TOKEN_FREQ_DIR)}
    total: Counter[int] = Counter()
    missing = []
    for rec in records:
        line = logged.get((rec.sample_id, rec.ids_sha256))
        if line is None:
            missing.append(rec)
            continue
        total.update(dict(zip(line["ids"], line["n"], strict=True)))
    return total + recount(root, missing, ids_key)


def write_token_freq(root: Path, counts: Counter[int]) -> None:
    """Write ``token_freq.pt`` atomically, as speculators reads it: ``{token id: count}``, Python ints."""
    table = {int(token): int(n) for token, n in sorted(counts.items())}
    atomic_write(Path(root) / TOKEN_FREQ_FILE, lambda f: torch.save(table, f))


def read_token_freq(root: Path) -> dict[int, int] | None:
    """``token_freq.pt`` as speculators loads it, or None if it is absent."""
    path = Path(root) / TOKEN_FREQ_FILE
    return torch.load(path, weights_only=True) if path.exists() else None
