"""Shared pytest fixtures. Keep each group together under its heading."""

from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from layertap.tiny import build_tiny_model

pytest_plugins = ["tests.sglang_fixtures", "tests.service_fixtures"]

# --- Property-based tests: the same examples on every run (a CI failure reproduces), each test sets its budget. ---

settings.register_profile(
    "layertap",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
settings.load_profile("layertap")

# --- Tiny models (layertap.tiny): built once per session, treat the folders as read-only. ---


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of the tiny Llama (6 layers, hidden 64, float32, seed 0)."""
    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_kimi(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of the tiny Kimi-K2-like DeepseekV3 (MLA + MoE, 5 layers, first dense, hidden 64, float32)."""
    return build_tiny_model("kimi-k2", tmp_path_factory.mktemp("tiny-kimi"))


@pytest.fixture(scope="session")
def tiny_kimi25(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of the tiny Kimi-K2.5 wrapper (DeepseekV3 as tiny_kimi under `language_model.`, a tiny
    vision tower, tokenizer as code: loading it needs trust_remote_code)."""
    return build_tiny_model("kimi-k2.5", tmp_path_factory.mktemp("tiny-kimi25"))


# --- Independent HF reference: a plain float32 forward with output_hidden_states, batch of one. ---


class HFReference:
    """Reference states for one model: ``states(ids)`` -> (hidden_states tuple of L+1 [T, H], pre-norm final [T, H]).

    The pre-norm final comes from a second copy of the model whose final norm is replaced by the
    identity, so its last ``output_hidden_states`` element is the un-normed residual stream. Nothing
    here shares code with the engines under test.
    """

    def __init__(self, model_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        model_dir = _unwrapped(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.no_norm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.no_norm.get_decoder().norm = torch.nn.Identity()

    def states(self, input_ids):
        import torch

        with torch.no_grad():
            ids = torch.as_tensor(input_ids, dtype=torch.long)[None]
            normed = self.model(ids, output_hidden_states=True).hidden_states
            pre = self.no_norm(ids, output_hidden_states=True).hidden_states[-1]
        return tuple(h[0] for h in normed), pre[0]


def _unwrapped(model_dir: Path) -> Path:
    """A multimodal wrapper's language model as a plain HF folder (its text_config as config.json, its
    `language_model.` weights without the prefix), written beside it; other folders as they are."""
    import json
    import tempfile

    from safetensors.torch import load_file, save_file

    config = json.loads((model_dir / "config.json").read_text())
    if "text_config" not in config:
        return model_dir
    plain = Path(tempfile.mkdtemp(prefix="unwrapped-"))
    (plain / "config.json").write_text(json.dumps(config["text_config"]))
    weights = load_file(model_dir / "model.safetensors")
    save_file({k.removeprefix("language_model."): v for k, v in weights.items() if k.startswith("language_model.")},
              plain / "model.safetensors", metadata={"format": "pt"})  # fmt: skip
    return plain


@pytest.fixture(scope="session")
def hf_reference():
    """``hf_reference(model_dir)`` -> a cached ``HFReference``."""
    cache: dict[Path, HFReference] = {}

    def get(model_dir: Path) -> HFReference:
        if model_dir not in cache:
            cache[model_dir] = HFReference(model_dir)
        return cache[model_dir]

    return get
