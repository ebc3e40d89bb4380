"""Tiny models the project builds itself: a byte-level BPE tokenizer, a chat template, two architectures."""

from layertap.models.tiny import KIMI_K2_EXTRA_CONFIG, TINY_ARCHS, TinyArch, build_tiny_model, model_dims
from layertap.models.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, build_tokenizer

__all__ = [
    "CHAT_TEMPLATE",
    "KIMI_K2_EXTRA_CONFIG",
    "SPECIAL_TOKENS",
    "TINY_ARCHS",
    "TinyArch",
    "build_tiny_model",
    "build_tokenizer",
    "model_dims",
]
