"""What a launched SGLang server is told for a folder: no SGLang tokenizer unless kept, its own dtype unless
given one (warned when SGLang would downcast), --trust-remote-code only when the run allows it; and what
dtype a server computes in."""

import logging

import pytest
import torch

from layertap.engines.sglang import KEEP_TOKENIZER_FLAG, server_model_args, sglang_compute_dtype
from layertap.models import ModelFolder
from layertap.tiny import build_tiny_model


@pytest.mark.parametrize(
    ("server", "folder", "computed"),
    [("auto", "float32", "float16"), ("auto", "bfloat16", "bfloat16"), ("float32", "float32", "float32"),
     ("half", "bfloat16", "float16")],
)  # fmt: skip
def test_compute_dtype(server, folder, computed) -> None:
    assert sglang_compute_dtype(server, folder) == computed


def test_launch_flags_follow_the_folder(tiny_kimi25, tmp_path, caplog) -> None:
    folder = ModelFolder.read(tiny_kimi25)
    skip = "--skip-tokenizer-init"
    assert server_model_args(folder, ["--tp-size", "2"], trust_remote_code=False) == [
        "--tp-size", "2", skip, "--dtype", "float32"]  # fmt: skip
    assert server_model_args(folder, [], trust_remote_code=True) == [skip, "--dtype", "float32", "--trust-remote-code"]
    given = ["--dtype=float32", "--trust-remote-code", skip]
    assert server_model_args(folder, given, trust_remote_code=True) == given
    with caplog.at_level(logging.WARNING):
        assert server_model_args(folder, ["--dtype", "auto"], trust_remote_code=False) == ["--dtype", "auto", skip]
    assert "float16" in caplog.text and "float32" in caplog.text
    bf16 = ModelFolder.read(build_tiny_model("kimi-k2.5", tmp_path / "bf16", dtype=torch.bfloat16, num_hidden_layers=2))
    assert server_model_args(bf16, [], trust_remote_code=False) == [skip, "--dtype", "bfloat16"]


def test_the_opt_out_keeps_sglang_tokenizer_and_is_not_passed_on(tiny_kimi25) -> None:
    folder = ModelFolder.read(tiny_kimi25)
    args = server_model_args(folder, [KEEP_TOKENIZER_FLAG, "--tp-size", "2"], trust_remote_code=False)
    assert args == ["--tp-size", "2", "--dtype", "float32"]


def test_a_config_only_folder_is_served_with_random_weights_and_refused_by_hf(tmp_path, caplog) -> None:
    from layertap.engines.hf import load_language_model
    from layertap.errors import SpecError

    folder = ModelFolder.read(build_tiny_model("kimi-k2.5", tmp_path / "config-only", config_only=True))
    assert not folder.has_weights and not list(folder.path.glob("*.safetensors"))
    with caplog.at_level(logging.WARNING):
        args = server_model_args(folder, [], trust_remote_code=True)
    assert args[-2:] == ["--load-format", "dummy"] and "random weights" in caplog.text
    given = ["--load-format=dummy"]  # the user's own spelling is kept, not doubled
    assert server_model_args(folder, given, trust_remote_code=False).count("--load-format") == 0
    with pytest.raises(SpecError, match=r"no weight files.*HF transformers needs its weights"):
        load_language_model(folder)
    with pytest.raises(ValueError, match=r"kimi-k2\.5"):
        build_tiny_model("llama", tmp_path / "llama", config_only=True)


def test_the_seed_depth_folder_has_kimi_k25s_depth_and_work_per_token(tmp_path) -> None:
    folder = ModelFolder.read(build_tiny_model("kimi-k2.5", tmp_path / "seed", shape="seed-depth", config_only=True))
    text = folder.text_config
    assert (folder.num_layers, folder.hidden_size, folder.wrapped) == (61, 7168, True)
    assert (text["n_routed_experts"], text["num_experts_per_tok"], text["n_shared_experts"]) == (8, 8, 1)
    assert text["first_k_dense_replace"] == 1 and not folder.has_weights
