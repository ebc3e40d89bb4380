"""Tokenizers for the loss-mask tests: the tiny model's own (ChatML-like template), and the same BPE with the
special tokens of a Llama-3-style and a Kimi-K2-style template added (templates in tests/assets/templates)."""

from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from layertap.tiny.tokenizer import build_tokenizer

ASSETS = Path(__file__).parents[2] / "assets"
DATASETS = ASSETS / "datasets"
TEMPLATES = ASSETS / "templates"

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
KIMI_SPECIALS = [
    "<|im_system|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_middle|>",
    "<|im_end|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
]


@pytest.fixture(scope="session")
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


@pytest.fixture(scope="session")
def llama3_tokenizer() -> PreTrainedTokenizerFast:
    tok = build_tokenizer()
    tok.add_tokens(LLAMA3_SPECIALS, special_tokens=True)
    tok.bos_token = "<|begin_of_text|>"
    tok.chat_template = (TEMPLATES / "llama3.jinja").read_text()
    return tok


@pytest.fixture(scope="session")
def kimi_tokenizer() -> PreTrainedTokenizerFast:
    tok = build_tokenizer()
    tok.add_tokens(KIMI_SPECIALS, special_tokens=True)
    tok.chat_template = (TEMPLATES / "kimi_k2.jinja").read_text()
    return tok
