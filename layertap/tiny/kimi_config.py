"""The config class shipped INSIDE the tiny Kimi-K2.5 folder, as the real model ships its own behind `auto_map`.

`build_tiny_model("kimi-k2.5", ...)` copies this file into the folder as `configuration_kimi_k25.py` and names
it in `config.json`'s `auto_map`, so `AutoConfig.from_pretrained(folder, trust_remote_code=True)` returns a
wrapper config whose `text_config` is a `DeepseekV3Config` (what trainers read through `text_config`), on a
transformers that has no `kimi_k25` type of its own. SGLang registers its own class for `kimi_k25`; this one
carries the same fields, so its `kimi_k25` model class reads either. Imports only transformers (it must load
from the folder alone).
"""

from __future__ import annotations

from typing import Any

from transformers import DeepseekV3Config, PretrainedConfig


class KimiK25VisionConfig(PretrainedConfig):
    """The MoonViT tower's and the projector's settings, kept as given (SGLang reads them by name)."""

    model_type = "kimi_k25_vision"


class KimiK25Config(PretrainedConfig):
    """Kimi-K2.5's wrapper: a DeepseekV3 language model (`text_config`) beside a vision tower (`vision_config`)."""

    model_type = "kimi_k25"
    sub_configs = {"text_config": DeepseekV3Config, "vision_config": KimiK25VisionConfig}  # noqa: RUF012

    def __init__(
        self,
        text_config: dict[str, Any] | DeepseekV3Config | None = None,
        vision_config: dict[str, Any] | KimiK25VisionConfig | None = None,
        ignore_index: int = -100,
        media_placeholder_token_id: int = 0,
        use_unified_vision_chunk: bool = False,
        video_placeholder: str = "<|kimi_k25_video_placeholder|>",
        **kwargs: Any,
    ) -> None:
        if not isinstance(text_config, DeepseekV3Config):
            text_config = DeepseekV3Config(**(text_config or {}))
        if not isinstance(vision_config, KimiK25VisionConfig):
            vision_config = KimiK25VisionConfig(**(vision_config or {}))
        self.text_config = text_config
        self.vision_config = vision_config
        self.ignore_index = ignore_index
        self.media_placeholder_token_id = media_placeholder_token_id
        self.use_unified_vision_chunk = use_unified_vision_chunk
        self.video_placeholder = video_placeholder
        super().__init__(**kwargs)

    @property
    def hidden_size(self) -> int:
        """The language model's width (readers of a plain causal LM's config ask the wrapper)."""
        return self.text_config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.text_config.vocab_size
