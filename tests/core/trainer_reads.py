"""What the trainers read from an output folder, read their way (nothing here shares code with layertap)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import load_file


def masked_token_counts(out: Path) -> Counter[int]:
    """Token id -> occurrences among the loss-masked tokens of every stored sample, read as each trainer reads
    them: SpecForge's ``.ckpt`` files (input_ids, loss_mask), or speculators' Arrow rows (input_ids,
    loss_mask) checked against ``hidden_states/hs_<row>.safetensors`` token_ids."""
    fmt = json.loads((out / "manifest.json").read_text())["format"]
    counts: Counter[int] = Counter()
    if fmt == "specforge":
        pairs = []
        for path in sorted(out.rglob("data_*.ckpt")):
            tensors = torch.load(path, weights_only=True)
            pairs.append((tensors["input_ids"], tensors["loss_mask"]))
    else:
        from datasets import load_from_disk

        rows = load_from_disk(str(out))
        pairs = []
        for row, item in enumerate(rows):
            token_ids = load_file(out / "hidden_states" / f"hs_{row}.safetensors")["token_ids"]
            assert torch.equal(token_ids, item["input_ids"]), f"row {row}: Arrow input_ids != file token_ids"
            pairs.append((item["input_ids"], item["loss_mask"]))
    for ids, mask in pairs:
        counts.update(ids[mask.bool()].tolist())
    return counts


def token_freq_file(out: Path) -> dict[int, int]:
    """``token_freq.pt`` loaded as speculators loads it; its keys and values must be Python ints."""
    table = torch.load(out / "token_freq.pt", weights_only=True)
    assert isinstance(table, dict) and all(type(k) is int and type(v) is int for k, v in table.items())
    return table
