"""The model folders users bring: one module reads their facts (layers, hidden size, module paths, tokenizer)."""

from layertap.models.folder import ModelFolder, model_dims

__all__ = ["ModelFolder", "model_dims"]
