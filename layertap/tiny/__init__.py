"""The tiny random-weight model folders layertap builds itself (demo, tests, benchmarks): never a user's folder."""

from layertap.tiny.build import KIMI_K2_EXTRA_CONFIG, SHAPES, TINY_ARCHS, TinyArch, build_tiny_model
from layertap.tiny.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, build_tokenizer

__all__ = [
    "CHAT_TEMPLATE",
    "KIMI_K2_EXTRA_CONFIG",
    "SHAPES",
    "SPECIAL_TOKENS",
    "TINY_ARCHS",
    "TinyArch",
    "build_tiny_model",
    "build_tokenizer",
]
