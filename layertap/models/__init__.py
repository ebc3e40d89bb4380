"""Model folders: reading their facts (`folder.py`), and the tiny models the project builds itself."""

from layertap.models.folder import ModelFolder, model_dims
from layertap.models.tiny import KIMI_K2_EXTRA_CONFIG, SHAPES, TINY_ARCHS, TinyArch, build_tiny_model
from layertap.models.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, build_tokenizer

__all__ = [
    "CHAT_TEMPLATE",
    "KIMI_K2_EXTRA_CONFIG",
    "SHAPES",
    "SPECIAL_TOKENS",
    "TINY_ARCHS",
    "ModelFolder",
    "TinyArch",
    "build_tiny_model",
    "build_tokenizer",
    "model_dims",
]
