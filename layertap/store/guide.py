"""``TRAIN.md``: exactly how to train on a store with its format's trainer, written from the manifest and the
index with the trainers' facts (``layertap.trainers``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from layertap.errors import SpecError
from layertap.models.folder import ModelFolder
from layertap.store.atomic import atomic_write
from layertap.store.index import SampleRecord
from layertap.store.manifest import Manifest
from layertap.trainers import (
    DRAFT_VOCAB,
    GUIDE,
    SPECFORGE_AUX_LAYERS,
    SPECFORGE_MAX_LENGTH,
    SPECULATORS_SEQ_LEN,
    TEXT_VIEW_SUFFIX,
    TOKEN_FREQ_FILE,
    specforge_draft_config,
    specforge_layer_ids,
    speculators_layer_ids,
    target_vocab_size,
)
from sglang_patch.contract import SPECFORGE


def training_guide(root: Path, manifest: Manifest, records: Sequence[SampleRecord], target: ModelFolder | None) -> str:
    """The text of ``TRAIN.md``: exactly how to train on the output at ``root`` (holding ``records``) with its
    format's trainer, from the ``target`` model folder's facts (None: not here, `target_folder`)."""
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
        *(
            [
                f"- Rows were rendered with the chat template variables `{json.dumps(variables)}`: serve the drafter "
                "with the same ones (SGLang's and vLLM's `chat_template_kwargs`)."
            ]
            if (variables := manifest.chat_template_kwargs)
            else []
        ),
        "",
    ]
    if manifest.target == "stream":
        lines += [
            "- This run wrote no sample files (`--stream-only`): its samples went to the stream's consumers, which "
            'acked them. Train from the stream as layertap\'s docs/streaming.md says ("In the trainer"); the '
            "layer, draft config and vocabulary settings below hold for it, the data paths do not.",
            "",
        ]
    if target is not None and target.wrapped:
        lines += [
            f"- The target is a multimodal wrapper: its language model's config is `text_config` and its weights "
            f"are under `{target.prefix}`; the settings below say so to each trainer.",
            "",
        ]
    if manifest.format == SPECFORGE:
        lines += _specforge_section(root, manifest, capture, longest, target)
    else:
        lines += _speculators_section(root, manifest, capture, longest, target)
    return "\n".join(lines) + "\n"


def target_folder(manifest: Manifest) -> ModelFolder | None:
    """The manifest's target folder's facts, or None where it is not here (a store verified on another machine),
    for a guide written outside the run that read the folder (verify, a worker's finalize)."""
    try:
        return ModelFolder.read(Path(manifest.model_path))
    except (SpecError, OSError):
        return None


def _specforge_wrapper_keys(target: ModelFolder | None) -> tuple[list[str], list[str]]:
    """(yaml lines under `model:`, why) for a wrapper: where its embedding and LM head are, and its config code."""
    if target is None or not target.wrapped:
        return [], []
    keys = [
        f"  embedding_key: {target.prefix}model.embed_tokens.weight",
        f"  lm_head_key: {target.prefix}lm_head.weight",
    ]
    why = [
        "`model.embedding_key` / `model.lm_head_key` name the language model's tensors under "
        f"`{target.prefix}` (SpecForge's defaults are a plain folder's `model.embed_tokens.weight` / "
        "`lm_head.weight`)."
    ]
    if "AutoConfig" in (target.config.get("auto_map") or {}):
        keys.append("  trust_remote_code: true")
        why.append(
            f"`model.trust_remote_code`: the folder's config class is code ({_config_code(target)}); SpecForge "
            "loads it and takes its `text_config` for the vocabulary, the width and the draft config it generates."
        )
    return keys, why


def _config_code(target: ModelFolder) -> str:
    """The file config.json's auto_map names for AutoConfig."""
    return f"`{target.config['auto_map']['AutoConfig'].rsplit('.', 1)[0]}.py`"


def _specforge_section(
    root: Path, manifest: Manifest, capture: list[int], longest: int, target: ModelFolder | None
) -> list[str]:
    keys, why = _specforge_wrapper_keys(target)
    ids = specforge_layer_ids(capture)
    out = [
        "## SpecForge 0.2.0 (offline EAGLE-3)",
        "",
        "`model.aux_hidden_state_layer_ids` are SGLang draft-config ids (capture index - 1). SGLang serves the "
        "drafter with the aux layers its draft config names under `eagle_config.eagle_aux_hidden_state_layer_ids` "
        "(without them it takes its default `[2, L // 2, L - 3]`), and SpecForge never writes that key: the draft "
        "config below carries it, and both training and the export take that file. `data.max_length` covers the "
        "longest sample (SpecForge cuts every sample to it, 2048 by default).",
        "",
    ]
    if target is None:
        out += [
            f"The target folder `{manifest.model_path}` is not here to write the draft config from: write one as "
            f'SpecForge generates it, with `"eagle_config": {{"eagle_aux_hidden_state_layer_ids": {ids}}}` '
            "added, and save it as `draft.json`.",
        ]
    else:
        out += [
            f"Save this draft config (SpecForge's own for this target, a draft vocabulary of at most {DRAFT_VOCAB:,} "
            "tokens: the most frequent loss-masked tokens of the `.ckpt` files, the counts of "
            f"`{TOKEN_FREQ_FILE}`) as `draft.json`:",
            "",
            "```json",
            json.dumps(specforge_draft_config(target.config, capture), indent=1),
            "```",
        ]
    out += [
        "",
        "```yaml",
        "model:",
        f"  target_model_path: {manifest.model_path}",
        f"  aux_hidden_state_layer_ids: {ids}",
        "  draft_model_config: draft.json",
        *keys,
        "data:",
        f"  hidden_states_path: {root}",
        f"  max_length: {max(longest, SPECFORGE_MAX_LENGTH)}",
        "training:",
        "  strategy: eagle3",
        "```",
        "",
        "Save it as `run.yaml` beside `draft.json` and run `specforge train --config run.yaml` there. SpecForge's "
        "target head reads the LM head through the model folder's `*.index.json`; a folder holding a single "
        "`model.safetensors` needs one. Then write the drafter SGLang serves (`--speculative-algorithm EAGLE3 "
        "--speculative-draft-model-path drafter`) from the run's `output_dir`:",
        "",
        "```bash",
        "specforge export --to sglang --checkpoint OUTPUT_DIR --draft-config draft.json --output-dir drafter",
        "```",
        *(f"\n{line}" for line in why),
    ]
    if len(capture) != SPECFORGE_AUX_LAYERS:
        out += [
            "",
            f"**Warning**: {len(capture)} aux layers. Stock SpecForge 0.2.0 trains on exactly "
            f"{SPECFORGE_AUX_LAYERS}; this output was made with `--allow-any-aux-layers` for a modified trainer.",
        ]
    return [*out, "", "speculators reads the `speculators` format, not this one: extract again with that format."]


def _speculators_section(
    root: Path, manifest: Manifest, capture: list[int], longest: int, target: ModelFolder | None
) -> list[str]:
    vocab = target_vocab_size(Path(manifest.model_path))
    draft_vocab = min(DRAFT_VOCAB, vocab) if vocab else DRAFT_VOCAB
    ids = " ".join(str(i) for i in speculators_layer_ids(capture))
    verifier, view, notes = str(manifest.model_path), [], []
    if target is not None and target.wrapped:
        verifier = f"{manifest.model_path}{TEXT_VIEW_SUFFIX}"
        view = [f"layertap text-view {manifest.model_path} {verifier}"]
        notes.append(
            "speculators loads the verifier's embedding and LM head after reading its config without "
            "`--trust-remote-code`, so it cannot take the wrapper: `layertap text-view` makes a text-only view "
            "(config.json = `text_config`, the language model's tensors by symlink to the wrapper's shards, nothing "
            "copied), and speculators trains against that."
        )
    backend, train_dtype = "", manifest.store_dtype
    if manifest.store_dtype == "fp8":
        backend, train_dtype = " --hidden-states-backend fp8", "bfloat16"
        notes.append(
            "The states are FP8 (float8_e4m3fn, with one float32 scale per token and state in `hidden_states_scales`): "
            "`--hidden-states-backend fp8` makes speculators dequantize each file as it reads it, to bfloat16 "
            "(without it, it would train on the unscaled FP8 values)."
        )
    flag = ""
    if target is not None and target.remote_code:
        flag = " --trust-remote-code"
        notes.append(
            "`--trust-remote-code`: speculators loads the folder's tokenizer (to pick a mask token) and it is code in "
            f"the folder ({', '.join(target.remote_code)}); its environment needs that code's imports."
        )
    return [
        "## speculators 0.9.0 (EAGLE-3)",
        "",
        "`--target-layer-ids` are vLLM's aux-layer ids, which are capture indices (the final layer is not listed: "
        "the last slot of each file is the pre-norm final state). `--draft-vocab-size` picks the most frequent "
        f"tokens of `{root / TOKEN_FREQ_FILE}`; `--total-seq-len` covers the longest sample.",
        *(f"\n{note}" for note in notes),
        "",
        "```bash",
        *view,
        f"speculators train --speculator-type eagle3 --verifier-name-or-path {verifier}{flag} \\",
        f"    --data-path {root} --target-layer-ids {ids} \\",
        f"    --draft-vocab-size {draft_vocab} --hidden-states-dtype {train_dtype}{backend} "
        f"--total-seq-len {max(longest, SPECULATORS_SEQ_LEN)}",
        "```",
        "",
        "SpecForge reads the `specforge` format, not this one: extract again with that format.",
    ]


def write_training_guide(
    root: Path, manifest: Manifest, records: Sequence[SampleRecord], target: ModelFolder | None
) -> str:
    """Write ``TRAIN.md`` beside the manifest (atomically) and return its text (`training_guide`)."""
    text = training_guide(root, manifest, records, target)
    atomic_write(Path(root) / GUIDE, lambda f: f.write(text.encode()))
    return text
