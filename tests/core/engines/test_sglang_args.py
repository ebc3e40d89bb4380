"""What a launched SGLang server is told for a folder: its own dtype unless given one (warned when SGLang
would downcast), --trust-remote-code only when the run allows it; and what dtype a server computes in."""

import logging

import pytest
import torch

from layertap.engines.sglang import server_model_args, sglang_compute_dtype
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
    assert server_model_args(folder, ["--tp-size", "2"], trust_remote_code=False) == ["--dtype", "float32"]
    assert server_model_args(folder, [], trust_remote_code=True) == ["--dtype", "float32", "--trust-remote-code"]
    assert server_model_args(folder, ["--dtype=float32", "--trust-remote-code"], trust_remote_code=True) == []
    with caplog.at_level(logging.WARNING):
        assert server_model_args(folder, ["--dtype", "auto"], trust_remote_code=False) == []
    assert "float16" in caplog.text and "float32" in caplog.text
    bf16 = ModelFolder.read(build_tiny_model("kimi-k2.5", tmp_path / "bf16", dtype=torch.bfloat16, num_hidden_layers=2))
    assert server_model_args(bf16, [], trust_remote_code=False) == ["--dtype", "bfloat16"]
