"""The trainers' side of the hand-off: what their EAGLE-3 code can take, their layer ids, and ``TRAIN.md``.

Facts read from the trainers' own source (the versions the interop tests pin):

- SpecForge 0.2.0: the EAGLE-3 draft's ``fc`` is ``Linear(3 * hidden, hidden)`` and
  ``resolve_eagle_capture_layers`` demands exactly three ids, so any other number of aux layers crashes
  at the first step after its reader accepted every file. Its ``model.aux_hidden_state_layer_ids`` are
  SGLang draft-config ids (SpecForge hands them to SGLang's ``set_eagle3_layers_to_capture``, which adds
  1): capture index - 1. Offline, it reads ``data.hidden_states_path`` recursively for ``*.ckpt`` and
  truncates every sample to ``data.max_length`` (default 2048).
- speculators 0.9.0: ``--target-layer-ids`` are vLLM's ``eagle_aux_hidden_state_layer_ids`` (vLLM
  keeps ``hidden_states + residual`` on entry to layer ``i``: the input of decoder layer ``i`` = HF
  ``output_hidden_states[i]`` = our capture index), written into the draft config for serving and
  used to size its ``fc`` (one ``hidden`` per id); the final layer vLLM appends (id = num_layers) is
  left out. Without the flag it silently assumes ``[2, L // 2, L - 3]``. It reads
  ``<data-path>/token_freq.pt`` (``torch.load(weights_only=True)`` of a ``{token id: count}`` dict of
  Python ints over the loss-masked tokens) to pick ``--draft-vocab-size`` tokens, and without it uses
  the whole target vocabulary. It packs samples into ``--total-seq-len`` tokens (default 8192),
  cutting longer ones.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from layertap.errors import SpecError
from sglang_patch.contract import SPECFORGE

if TYPE_CHECKING:  # the spec imports this module: keep it free of torch, so light commands start fast
    from layertap.store.index import SampleRecord
    from layertap.store.manifest import Manifest

SPECFORGE_AUX_LAYERS = 3
DRAFT_VOCAB = 32000  # both trainers' usual draft vocabulary (SpecForge's default), capped at the target's
SPECULATORS_SEQ_LEN = 8192  # speculators' default --total-seq-len
SPECFORGE_MAX_LENGTH = 2048  # SpecForge's default data.max_length
GUIDE = "TRAIN.md"
TOKEN_FREQ_FILE = "token_freq.pt"


def check_trainer_takes(fmt: str, layers: Sequence[int]) -> None:
    """Refuse (SpecError) aux capture indices that ``fmt``'s stock trainer cannot train on."""
    if fmt == SPECFORGE and len(layers) != SPECFORGE_AUX_LAYERS:
        raise SpecError(
            f"--format specforge with {len(layers)} aux layers (capture indices {list(layers)}): SpecForge 0.2.0's "
            f"EAGLE-3 draft takes exactly {SPECFORGE_AUX_LAYERS} (its fc layer is Linear(3 * hidden, hidden)); its "
            "reader would accept every file and training would crash at the first step. Give 3 layer ids, use "
            "--format speculators (any number), or pass --allow-any-aux-layers if your trainer is modified to take "
            f"{len(layers)}."
        )


def specforge_layer_ids(capture: Sequence[int]) -> list[int]:
    """SpecForge's ``model.aux_hidden_state_layer_ids`` (SGLang draft-config ids) for capture indices."""
    return [i - 1 for i in capture]


def speculators_layer_ids(capture: Sequence[int]) -> list[int]:
    """speculators' ``--target-layer-ids`` (vLLM aux-layer ids, final layer left out) for capture indices."""
    return list(capture)


def target_vocab_size(model: Path) -> int | None:
    """The target's vocabulary size from its config.json (a wrapped language model's ``text_config`` too)."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    return int(size) if size else None


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
    from layertap.store.atomic import atomic_write

    text = training_guide(root, manifest, records)
    atomic_write(Path(root) / GUIDE, lambda f: f.write(text.encode()))
    return text
