"""In-process HF transformers engine (CPU or GPU): the reference-quality, no-server path.

The model is the folder's language model, always built by transformers itself: a multimodal wrapper
(Kimi-K2.5) gives its ``text_config`` and its ``language_model.`` weights, and no vendor code runs.

Batches are right-padded: with a causal mask a real token never attends to a later pad, so the
rows of each sample are identical to a batch-of-one forward; only the first T rows per sample are
kept, so padding is never stored.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import transformers
from transformers import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)

from layertap.device import pick_device
from layertap.engines.base import Engine
from layertap.errors import SpecError
from layertap.models.folder import ModelFolder
from layertap.models.weights import FolderWeights, layer_of
from layertap.sample import CapturedSample, TokenizedSample
from layertap.spec import CaptureSpec


def token_batches(
    samples: Iterable[TokenizedSample], *, max_tokens: int, max_size: int
) -> Iterator[list[TokenizedSample]]:
    """Group samples so that (batch size x longest sample) stays under ``max_tokens``."""
    batch: list[TokenizedSample] = []
    longest = 0
    for s in samples:
        new_longest = max(longest, s.num_tokens)
        if batch and (len(batch) >= max_size or new_longest * (len(batch) + 1) > max_tokens):
            yield batch
            batch, new_longest = [], s.num_tokens
        batch.append(s)
        longest = new_longest
    if batch:
        yield batch


def language_config(folder: ModelFolder, num_layers: int | None = None) -> PretrainedConfig:
    """The language model's transformers config: a wrapper's ``text_config``, a quantized folder's without its
    quantization (layertap hands transformers plain, dequantized weights), cut to ``num_layers`` when given."""
    layers = {} if num_layers is None else {"num_hidden_layers": num_layers}
    if not folder.wrapped and folder.quantization is None:
        return AutoConfig.from_pretrained(folder.path, **layers)
    fields = {k: v for k, v in folder.text_config.items() if k != "quantization_config"}
    return AutoConfig.for_model(**{**fields, **layers})


def load_language_model(
    folder: ModelFolder, dtype: torch.dtype | None = None, device: torch.device | None = None
) -> PreTrainedModel:
    """The folder's causal LM in ``dtype`` (default: the folder's own). For a wrapper, the model class of
    ``text_config``'s type loads the ``language_model.``-prefixed weights; the vision tower is left out. A quantized
    folder's packed INT4 weights are dequantized exactly by layertap (``models/weights.py``), never by a library. On a
    GPU ``device`` the weights go there as they load (a model that fits the GPU need not fit host memory twice)."""
    check_has_weights(folder)
    dtype = dtype or getattr(torch, folder.dtype)
    config = language_config(folder)
    placed = {"device_map": device} if device is not None and device.type != "cpu" else {}
    if folder.quantization is not None:
        return _load_dequantized(folder, config, dtype, placed)
    if not folder.wrapped:
        return AutoModelForCausalLM.from_pretrained(folder.path, config=config, dtype=dtype, **placed)
    model, info = AutoModelForCausalLM.from_pretrained(
        folder.path,
        config=config,
        dtype=dtype,
        **placed,
        key_mapping={"^" + folder.prefix.replace(".", r"\."): ""},
        output_loading_info=True,
    )
    _check_loaded(folder, info, unexpected=False)
    return model


def check_has_weights(folder: ModelFolder) -> None:
    """SpecError for a config-only folder: HF transformers (the engine, the audit) needs real weights."""
    if not folder.has_weights:
        raise SpecError(
            f"model {folder.path} has no weight files (a config-only folder): HF transformers needs its weights; "
            "only an SGLang server can run it, with random weights (--load-format dummy), for benchmarks"
        )


def _load_dequantized(
    folder: ModelFolder, config: PretrainedConfig, dtype: torch.dtype, placed: dict[str, Any]
) -> PreTrainedModel:
    """A quantized folder's language model from a state dict of its plain and dequantized tensors, under its
    config without the quantization (so transformers takes the weights as they are and quantizes nothing)."""
    weights = FolderWeights(folder)
    names = [n for n in weights.names if (layer := layer_of(n)) is None or layer < config.num_hidden_layers]
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # the Auto class needs a folder; the state dict is ours
    try:
        model, info = model_class.from_pretrained(
            None, config=config, state_dict=weights.read(names, dtype), dtype=dtype, output_loading_info=True, **placed
        )
    except RuntimeError as exc:  # transformers could not merge the per-expert tensors into its own
        raise SpecError(f"model {folder.path}: missing keys or shapes in its checkpoint ({exc})") from exc
    _check_loaded(folder, info, unexpected=True)
    return model


def _check_loaded(folder: ModelFolder, info: dict[str, Any], *, unexpected: bool) -> None:
    """SpecError when weights were left at random (missing) or not taken (unexpected, mismatched): a model so
    loaded would pass for the folder's own."""
    kinds = ["missing_keys"] + (["unexpected_keys", "mismatched_keys"] if unexpected else [])
    for kind in kinds:
        if keys := sorted(map(str, info.get(kind) or ())):
            raise SpecError(
                f"model {folder.path}: {kind.replace('_', ' ')} loading its language model under "
                f"{folder.prefix or 'the folder'}: {keys[:5]} ({len(keys)} in all)"
            )


class HFEngine(Engine):
    """Captures with ``output_hidden_states`` plus a pre-hook on the final norm for the pre-norm state."""

    def __init__(
        self,
        folder: ModelFolder,
        spec: CaptureSpec,
        *,
        device: str,
        dtype: torch.dtype | None,
        max_batch_tokens: int,
        max_batch_size: int,
    ) -> None:
        """The language model of ``folder`` (as the run read it) on ``device``, computing in ``dtype`` (None: the
        folder's own); the settings come from `RunSettings` (`hf_engine_factory`), which holds their defaults."""
        self.spec = spec
        self.device = pick_device(device)
        causal = load_language_model(folder, dtype, self.device)
        # The base model skips the LM head: we only need hidden states.
        self.model = causal.get_decoder().to(self.device).eval()
        self.compute_dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        self._pre_norm: torch.Tensor | None = None
        self.model.norm.register_forward_pre_hook(self._keep_pre_norm)

    def _keep_pre_norm(self, _module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        self._pre_norm = args[0]

    def describe(self) -> dict[str, Any]:
        return {
            "name": "hf",
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "device": str(self.device),
        }

    def capture(self, samples: Iterable[TokenizedSample]) -> Iterator[CapturedSample]:
        for batch in token_batches(samples, max_tokens=self.max_batch_tokens, max_size=self.max_batch_size):
            yield from self._forward(batch)

    @torch.inference_mode()
    def _forward(self, batch: list[TokenizedSample]) -> list[CapturedSample]:
        longest = max(s.num_tokens for s in batch)
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        attn = torch.zeros(len(batch), longest, dtype=torch.long)
        for row, s in enumerate(batch):
            ids[row, : s.num_tokens] = s.input_ids
            attn[row, : s.num_tokens] = 1
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=attn.to(self.device),
            output_hidden_states=True,
            use_cache=False,
        )
        aux = torch.stack([out.hidden_states[i] for i in self.spec.layers], dim=2)  # [B, T, k, H]
        post, pre = out.last_hidden_state, self._pre_norm
        self._pre_norm = None
        results = []
        for row, s in enumerate(batch):
            t = s.num_tokens
            results.append(
                CapturedSample(
                    sample=s,
                    aux=aux[row, :t].to("cpu", copy=True),
                    final_post=post[row, :t].to("cpu", copy=True) if self.spec.final_post else None,
                    final_pre=pre[row, :t].to("cpu", copy=True) if self.spec.final_pre else None,
                )
            )
        return results
