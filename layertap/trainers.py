"""What the trainers take: their EAGLE-3 code's limits, their layer ids, their file names (``TRAIN.md`` is
written from these by ``layertap.store.guide``). Imported by the spec: keep it free of torch.

Facts read from the trainers' own source (the versions the interop tests pin):

- SpecForge 0.2.0: the EAGLE-3 draft's ``fc`` is ``Linear(3 * hidden, hidden)`` and
  ``resolve_eagle_capture_layers`` demands exactly three ids, so any other number of aux layers crashes
  at the first step after its reader accepted every file. Its ``model.aux_hidden_state_layer_ids`` are
  SGLang draft-config ids (SpecForge hands them to SGLang's ``set_eagle3_layers_to_capture``, which adds
  1): capture index - 1. Offline, it reads ``data.hidden_states_path`` recursively for ``*.ckpt`` and
  truncates every sample to ``data.max_length`` (default 2048). It saves no draft config: ``training_state.pt``
  holds the weights, and ``specforge export --to sglang --draft-config FILE`` writes FILE's config beside them
  as it is (``export/to_sglang.py``). SpecForge only ever reads ``eagle_config.eagle_aux_hidden_state_layer_ids``
  (``algorithms/model_providers.py`` ``resolve_eagle_capture_layers``), and SGLang (0.5.10 and 0.5.14,
  ``model_runner.py``) takes the aux layers to serve with from that key of the draft config alone; without it
  SGLang captures its default ``[2, L // 2, L - 3]`` (``models/llama.py`` ``set_eagle3_layers_to_capture``) and
  a drafter trained on other layers is served the wrong states, silently. So the draft config layertap writes
  for SpecForge carries the ids, and training and the export both take it.
- speculators 0.9.0: ``--target-layer-ids`` are vLLM's ``eagle_aux_hidden_state_layer_ids`` (vLLM
  keeps ``hidden_states + residual`` on entry to layer ``i``: the input of decoder layer ``i`` = HF
  ``output_hidden_states[i]`` = our capture index), written into the draft config for serving and
  used to size its ``fc`` (one ``hidden`` per id); the final layer vLLM appends (id = num_layers) is
  left out. Without the flag it silently assumes ``[2, L // 2, L - 3]``. It reads
  ``<data-path>/token_freq.pt`` (``torch.load(weights_only=True)`` of a ``{token id: count}`` dict of
  Python ints over the loss-masked tokens) to pick ``--draft-vocab-size`` tokens, and without it uses
  the whole target vocabulary. It packs samples into ``--total-seq-len`` tokens (default 8192),
  cutting longer ones.

A multimodal wrapper target (Kimi-K2.5: ``text_config``, weights under ``language_model.``, its config class
code behind ``auto_map``), read from the same versions' source:

- SpecForge reads the target's embedding and LM head by ``model.embedding_key`` / ``model.lm_head_key``
  (defaults ``model.embed_tokens.weight`` / ``lm_head.weight``: a ``KeyError`` on a wrapper) and its config with
  ``AutoConfig.from_pretrained(trust_remote_code=model.trust_remote_code)``, then takes ``text_config`` for the
  vocabulary, the width and the generated draft config (a Llama EAGLE-3 draft with a 32000-token draft
  vocabulary, mapped from the loss-masked ``input_ids`` of the ``.ckpt`` files: the counts of token_freq.pt).
- speculators loads the verifier's embedding and LM head after ``AutoConfig.from_pretrained(verifier)`` WITHOUT
  ``trust_remote_code`` (``Eagle3DraftModel.load_verifier_weights``): a config class in the folder is refused
  whatever flag is given, so it trains on a text-only view (``layertap.models.text_view``), whose embedding and
  LM head it finds by name suffix. Before that it loads the verifier's tokenizer (to pick a mask token) with
  ``--trust-remote-code``: a tokenizer that is code in the folder needs the flag (and its imports, tiktoken for
  Kimi's, in the trainer's environment).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from layertap.errors import SpecError
from sglang_patch.contract import SPECFORGE

SPECFORGE_AUX_LAYERS = 3
DRAFT_VOCAB = 32000  # both trainers' usual draft vocabulary (SpecForge's default), capped at the target's
SPECULATORS_SEQ_LEN = 8192  # speculators' default --total-seq-len
SPECFORGE_MAX_LENGTH = 2048  # SpecForge's default data.max_length
GUIDE = "TRAIN.md"
TEXT_VIEW_SUFFIX = "-text-view"  # where TRAIN.md puts a wrapper's text-only view: beside the model folder
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


# The fields SpecForge 0.2.0 copies from the target's (language model's) config when it generates an EAGLE-3
# draft config itself (``training/model_loading.py`` ``_TARGET_ARCHITECTURE_FIELDS``).
_DRAFT_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                 "max_position_embeddings", "rms_norm_eps", "hidden_act", "initializer_range", "attention_bias",
                 "attention_dropout", "head_dim", "rope_theta", "rope_scaling", "rope_parameters", "bos_token_id", "eos_token_id",
                 "pad_token_id")  # fmt: skip


def specforge_draft_config(target_config: dict, capture: Sequence[int]) -> dict:
    """The EAGLE-3 draft config SpecForge 0.2.0 would generate for the target (one Llama layer, a draft
    vocabulary of at most ``DRAFT_VOCAB``), plus the SGLang aux-layer ids of ``capture`` under
    ``eagle_config``: the one key SGLang serves the drafter's layers from, which SpecForge never writes."""
    text = target_config.get("text_config") or target_config
    draft = {k: text[k] for k in _DRAFT_FIELDS if text.get(k) is not None}
    vocab = int(text["vocab_size"])
    return draft | {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "tie_word_embeddings": False, "use_cache": True, "pad_token_id": draft.get("pad_token_id", 0),
        "vocab_size": vocab, "draft_vocab_size": min(DRAFT_VOCAB, vocab),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": specforge_layer_ids(capture)},
    }  # fmt: skip


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
