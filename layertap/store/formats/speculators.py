"""speculators' layout: a ``datasets`` Arrow folder plus ``hidden_states/hs_<row>.safetensors``.

Each safetensors file holds ``token_ids`` long [T] and ``hidden_states`` [T, k+1, H]: the aux layers
in capture-index order, then the final state BEFORE the norm (the trainer applies ``verifier_norm``).
An FP8 store (``store_dtype`` fp8) holds them as float8_e4m3fn with ``hidden_states_scales`` float32
[T, k+1, 1] beside them, which speculators dequantizes with ``--hidden-states-backend fp8``.
The Arrow rows (``input_ids``, ``loss_mask``, ``seq_len``, torch format) must line up with the file
numbers: speculators loads ``hs_<row>`` for Arrow row ``row``.

Samples are written once to ``samples/hs_<dataset index>.safetensors``. Because failed or skipped
rows leave gaps, ``finalize`` publishes ``hidden_states/hs_<row>`` as hard links (no bytes copied)
numbered by Arrow row, and rebuilds the Arrow folder; both are rebuilt from the index on every
finalize, so a resumed run simply re-finalizes.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from layertap.sample import CapturedSample
from layertap.store.atomic import TMP_MARK
from layertap.store.formats.base import SampleFormat, torch_dtype
from layertap.store.index import SampleRecord
from sglang_patch.contract import SPECULATORS, SampleLayout
from sglang_patch.sample_files import FP8, FP8_SCALES, quantize_fp8, speculators_tensors, stack_aux_final
from sglang_patch.writer import fsync_path

PUBLISHED = "hidden_states"


class SpeculatorsFormat(SampleFormat):
    name = SPECULATORS
    sample_glob = "samples/hs_*.safetensors"
    state_keys = ("hidden_states", FP8_SCALES)  # the scales only in an FP8 store

    def relpath(self, index: int) -> str:
        return f"samples/hs_{index}.safetensors"

    def tensors(self, captured: CapturedSample, layout: SampleLayout) -> dict[str, torch.Tensor]:
        """The sample as its file holds it (and a stream carries it): ``token_ids``, ``hidden_states`` in the store's
        dtype (FP8: with ``hidden_states_scales``); no copy of the states when the capture is a dump already so."""
        if captured.final_pre is None:
            raise ValueError("speculators stores the pre-norm final state; the capture has none")
        scales, dtype = captured.scales, torch_dtype(layout)
        if scales is not None:  # quantized by the server already
            states = stack_aux_final(captured.aux, captured.final_pre)
        elif dtype == FP8:  # from the compute dtype, as the capture server does on its device
            states, scales = quantize_fp8(stack_aux_final(captured.aux, captured.final_pre))
        else:
            states = stack_aux_final(captured.aux.to(dtype), captured.final_pre.to(dtype))
        return speculators_tensors(captured.sample.input_ids, states, scales)

    def load(self, path: Path) -> dict[str, torch.Tensor]:
        return load_file(path)

    def finalize(self, root: Path, records: list[SampleRecord]) -> None:
        _publish_links(root, records)
        _write_arrow(root, records)

    def finalized_problems(self, root: Path, records: list[SampleRecord]) -> list[str]:
        from datasets import load_from_disk

        out: list[str] = []
        try:
            ds = load_from_disk(str(root))
        except Exception as exc:
            return [f"Arrow dataset unreadable: {exc}"]
        if len(ds) != len(records):
            return [f"Arrow dataset has {len(ds)} rows, index has {len(records)} samples"]
        for row, rec in enumerate(records):
            item = ds[row]
            link = root / PUBLISHED / f"hs_{row}.safetensors"
            if not link.exists() or not os.path.samefile(link, root / rec.file):
                out.append(f"row {row} ({rec.sample_id}): {link.name} is not the committed file {rec.file}")
            if int(item["seq_len"]) != rec.num_tokens or not torch.equal(
                item["loss_mask"].to(torch.uint8), rec.loss_mask()
            ):
                out.append(f"row {row} ({rec.sample_id}): Arrow seq_len/loss_mask differ from the index")
        return out


def _publish_links(root: Path, records: list[SampleRecord]) -> None:
    """Rebuild ``hidden_states/`` as hard links numbered by Arrow row, then swap it in."""
    staging = root / f"{TMP_MARK}{PUBLISHED}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    for row, rec in enumerate(records):
        os.link(root / rec.file, staging / f"hs_{row}.safetensors")
    fsync_path(staging)
    final = root / PUBLISHED
    old = root / f"{TMP_MARK}{PUBLISHED}.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    staging.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    fsync_path(root)


def _rows(root: Path, records: list[SampleRecord]):
    for rec in records:
        ids = load_file(root / rec.file)["token_ids"]
        yield {
            "sample_id": rec.sample_id,
            "dataset_index": rec.index,
            "input_ids": ids.tolist(),
            "loss_mask": rec.loss_mask().to(torch.long).tolist(),
            "seq_len": rec.num_tokens,
        }


def _write_arrow(root: Path, records: list[SampleRecord]) -> None:
    """Write the Arrow folder (torch format, as speculators indexes it) beside the sample files; no records
    give an Arrow folder of 0 rows with the same columns."""
    from datasets import Dataset, Features, Sequence, Value

    features = Features(
        {
            "sample_id": Value("string"),
            "dataset_index": Value("int64"),
            "input_ids": Sequence(Value("int64")),
            "loss_mask": Sequence(Value("int64")),
            "seq_len": Value("int64"),
        }
    )
    staging = root / f"{TMP_MARK}arrow"
    shutil.rmtree(staging, ignore_errors=True)
    if records:
        ds = Dataset.from_generator(
            _rows, gen_kwargs={"root": root, "records": records}, features=features, cache_dir=str(staging / "cache")
        )
    else:  # a generator that yields nothing makes no dataset at all
        ds = Dataset.from_dict({name: [] for name in features}, features=features)
    ds.set_format("torch", columns=["input_ids", "loss_mask", "seq_len"], output_all_columns=True)
    ds.save_to_disk(str(staging / "out"), num_shards=None if records else 1)  # 0 rows would be saved as 0 shards
    for old in root.glob("data-*.arrow"):
        old.unlink()
    for path in sorted((staging / "out").iterdir()):
        os.replace(path, root / path.name)
    shutil.rmtree(staging, ignore_errors=True)
    fsync_path(root)
