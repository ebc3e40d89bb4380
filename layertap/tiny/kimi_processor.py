"""A processor class shipped INSIDE the tiny Kimi-K2.5 folder, beside its tokenizer class, as the real model ships its own.

`build_tiny_model("kimi-k2.5", ...)` copies this file into the folder as `processing_tiny_kimi.py` and names it in
`preprocessor_config.json`'s `auto_map`, so `AutoProcessor.from_pretrained(folder, trust_remote_code=True)`
returns it. SGLang builds its Kimi-K2.5 multimodal processor from that object even for text-only serving, and
(0.5.14) reads at start-up `.tokenizer`, `.image_processor` and `.media_processor.media_proc_cfg` (patch size,
merge kernel, patch limits, normalisation). Without a processor, AutoProcessor falls back to the bare tokenizer
and that start-up dies on `media_processor`.

It serves text only: the settings are real (they match the folder's vision tower), but image preprocessing is
not implemented, and an image gets a clear error rather than being dropped. Imports only the standard library
and transformers (it must load from the folder alone).
"""

from __future__ import annotations

import json
from typing import Any

from transformers import AutoTokenizer, BatchEncoding, PreTrainedTokenizerBase, ProcessorMixin
from transformers.utils import cached_file

PROCESSOR_CONFIG = "preprocessor_config.json"
_FILE_KWARGS = ("cache_dir", "revision", "token", "local_files_only")


class TinyKimiMediaProcessor:
    """The image side's settings, under the name and keys SGLang reads (`media_proc_cfg`)."""

    def __init__(self, media_proc_cfg: dict[str, Any]) -> None:
        self.media_proc_cfg = media_proc_cfg


class TinyKimiProcessor(ProcessorMixin):
    """The folder's tokenizer plus its media settings; `image_processor` is the media processor (SGLang reads both)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, media_processor: TinyKimiMediaProcessor) -> None:
        super().__init__(tokenizer=tokenizer)
        self.media_processor = media_processor
        self.image_processor = media_processor

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str, trust_remote_code: bool = False, **kwargs: Any
    ) -> TinyKimiProcessor:
        """Tokenizer through AutoTokenizer (it is folder code too), `media_proc_cfg` from preprocessor_config.json."""
        file_kwargs = {k: kwargs[k] for k in _FILE_KWARGS if k in kwargs}
        with open(cached_file(pretrained_model_name_or_path, PROCESSOR_CONFIG, **file_kwargs), encoding="utf-8") as f:
            media_proc_cfg = json.load(f)["media_proc_cfg"]
        tokenizer = AutoTokenizer.from_pretrained(
            pretrained_model_name_or_path, trust_remote_code=trust_remote_code, **file_kwargs
        )
        return cls(tokenizer, TinyKimiMediaProcessor(media_proc_cfg))

    def __call__(self, text: Any = None, images: Any = None, **kwargs: Any) -> BatchEncoding:
        """Tokenize text; refuse images (and Kimi's `medias`) instead of silently dropping them."""
        if images is not None or kwargs.pop("medias", None):
            raise ValueError(f"{type(self).__name__} serves text only: this tiny folder does not preprocess images")
        return self.tokenizer(text, **kwargs)
