"""``TRAIN.md``: exactly how to train on a store with its format's trainer, written from the manifest and the
index with the trainers' facts (``layertap.trainers``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from layertap.store.atomic import atomic_write
from layertap.store.index import SampleRecord
from layertap.store.manifest import Manifest
from layertap.trainers import (
    DRAFT_VOCAB,
    GUIDE,
    SPECFORGE_AUX_LAYERS,
    SPECFORGE_MAX_LENGTH,
    SPECULATORS_SEQ_LEN,
    TOKEN_FREQ_FILE,
    specforge_layer_ids,
    speculators_layer_ids,
    target_vocab_size,
)
from sglang_patch.contract import SPECFORGE


def training_guide(root: Path, manifest: Manifest, records: Sequence[SampleRecord]) -> str:
    """The text of ``TRAIN.md``: exactly how to train on the output at ``root`` (holding ``records``) with its
    format's trainer."""
    root = Path(root).resolve()
    samples, tokens = len(records), sum(r.num_tokens for r in records)
    longest = max((r.num_tokens for r in records), default=0)
    capture = list(manifest.capture_indices)
    final = "post-norm" if manifest.format == SPECFORGE else "pre-norm"
    lines = [
        "# Training on this output",
        "",
        f"Written by layertap {manifest.layertap_version} (`layertap verify {root}` re-checks every file and rewrites "
        "this guide).",
        "",
        f"- Output: `{root}`, format `{manifest.format}`, {samples:,} samples, {tokens:,} tokens, longest sample "
        f"{longest:,} tokens, states stored as {manifest.store_dtype}.",
        f"- Target model: `{manifest.model_path}` ({manifest.num_layers} decoder layers, hidden size "
        f"{manifest.hidden_size}).",
        f"- Aux layers, as capture indices (id i = input of decoder layer i = HF `output_hidden_states[i]`): "
        f"{capture}; given as {list(manifest.layer_ids_given)} in the `{manifest.layer_convention}` convention.",
        f"- Final hidden state: {final}.",
        f"- Token frequencies over the loss-masked tokens: `{TOKEN_FREQ_FILE}`.",
        "",
    ]
    if manifest.format == SPECFORGE:
        lines += _specforge_section(root, manifest, capture, longest)
    else:
        lines += _speculators_section(root, manifest, capture, longest)
    return "\n".join(lines) + "\n"


def _specforge_section(root: Path, manifest: Manifest, capture: list[int], longest: int) -> list[str]:
    out = [
        "## SpecForge 0.2.0 (offline EAGLE-3)",
        "",
        "`model.aux_hidden_state_layer_ids` are SGLang draft-config ids (capture index - 1); SpecForge writes them "
        "into the draft config that SGLang later serves with. `data.max_length` covers the longest sample "
        "(SpecForge cuts every sample to it, 2048 by default).",
        "",
        "```yaml",
        "model:",
        f"  target_model_path: {manifest.model_path}",
        f"  aux_hidden_state_layer_ids: {specforge_layer_ids(capture)}",
        "data:",
        f"  hidden_states_path: {root}",
        f"  max_length: {max(longest, SPECFORGE_MAX_LENGTH)}",
        "training:",
        "  strategy: eagle3",
        "```",
        "",
        "Save it as `run.yaml` and run `specforge train --config run.yaml`. SpecForge's target head reads the "
        "LM head through the model folder's `*.index.json`; a folder holding a single `model.safetensors` needs one.",
    ]
    if len(capture) != SPECFORGE_AUX_LAYERS:
        out += [
            "",
            f"**Warning**: {len(capture)} aux layers. Stock SpecForge 0.2.0 trains on exactly "
            f"{SPECFORGE_AUX_LAYERS}; this output was made with `--allow-any-aux-layers` for a modified trainer.",
        ]
    return [*out, "", "speculators reads the `speculators` format, not this one: extract again with that format."]


def _speculators_section(root: Path, manifest: Manifest, capture: list[int], longest: int) -> list[str]:
    vocab = target_vocab_size(Path(manifest.model_path))
    draft_vocab = min(DRAFT_VOCAB, vocab) if vocab else DRAFT_VOCAB
    ids = " ".join(str(i) for i in speculators_layer_ids(capture))
    return [
        "## speculators 0.9.0 (EAGLE-3)",
        "",
        "`--target-layer-ids` are vLLM's aux-layer ids, which are capture indices (the final layer is not listed: "
        "the last slot of each file is the pre-norm final state). `--draft-vocab-size` picks the most frequent "
        f"tokens of `{root / TOKEN_FREQ_FILE}`; `--total-seq-len` covers the longest sample.",
        "",
        "```bash",
        f"speculators train --speculator-type eagle3 --verifier-name-or-path {manifest.model_path} \\",
        f"    --data-path {root} --target-layer-ids {ids} \\",
        f"    --draft-vocab-size {draft_vocab} --hidden-states-dtype {manifest.store_dtype} "
        f"--total-seq-len {max(longest, SPECULATORS_SEQ_LEN)}",
        "```",
        "",
        "SpecForge reads the `specforge` format, not this one: extract again with that format.",
    ]


def write_training_guide(root: Path, manifest: Manifest, records: Sequence[SampleRecord]) -> str:
    """Write ``TRAIN.md`` beside the manifest (atomically) and return its text."""
    text = training_guide(root, manifest, records)
    atomic_write(Path(root) / GUIDE, lambda f: f.write(text.encode()))
    return text
