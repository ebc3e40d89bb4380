"""The tiny tokenizer: deterministic, lossless on any Unicode, offsets usable; the chat template's format."""

import hashlib
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from layertap.tiny import SPECIAL_TOKENS, build_tokenizer

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return build_tokenizer()


def _tokenizer_json_sha(tokenizer: PreTrainedTokenizerFast, folder: Path) -> str:
    tokenizer.save_pretrained(folder)
    return hashlib.sha256((folder / "tokenizer.json").read_bytes()).hexdigest()


def test_build_is_byte_identical_across_builds_and_processes(tok: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    here = _tokenizer_json_sha(tok, tmp_path / "a")
    assert _tokenizer_json_sha(build_tokenizer(), tmp_path / "b") == here
    # A fresh interpreter has a different hash seed: training must not depend on it.
    code = (
        "import hashlib, sys; from layertap.tiny import build_tokenizer; "
        "build_tokenizer().save_pretrained(sys.argv[1]); "
        "print(hashlib.sha256(open(sys.argv[1] + '/tokenizer.json', 'rb').read()).hexdigest())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "c")], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == here


def test_vocabulary_and_special_tokens(tok: PreTrainedTokenizerFast) -> None:
    assert 1000 <= len(tok) <= 2000
    assert tok.unk_token is None
    for token in SPECIAL_TOKENS:
        assert tok.encode(token) == [tok.convert_tokens_to_ids(token)]
    assert tok.bos_token == "<|bos|>" and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|pad|>"
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3
    # BOS comes from the chat template only, so encode must not add it.
    assert tok.encode("hello", add_special_tokens=True) == tok.encode("hello", add_special_tokens=False)


def _random_unicode(rng: random.Random, n: int) -> str:
    ranges = [(0x20, 0x7E), (0x0, 0x1F), (0xA0, 0x2FF), (0x400, 0x4FF), (0x4E00, 0x4FFF), (0x1F300, 0x1F64F)]
    chars = []
    for _ in range(n):
        lo, hi = rng.choice(ranges)
        chars.append(chr(rng.randint(lo, hi)))
    return "".join(chars)


TRICKY = [
    "",
    " ",
    "  leading and trailing spaces  ",
    "line\r\nbreaks\n\n\ttabs",
    "e\u0301 combining, \u200d zero-width joiner, \ufeff BOM, \u00a0 nbsp",
    "👩‍👩‍👧 family emoji, 🇫🇷 flag, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "literal <|im_start|> inside text and <|not_special|>",
    '{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}',
]


@pytest.mark.parametrize("seed", range(5))
def test_round_trips_and_offsets_cover_random_unicode(tok: PreTrainedTokenizerFast, seed: int) -> None:
    rng = random.Random(seed)
    for text in [*TRICKY, _random_unicode(rng, 300)]:
        enc = tok(text, return_offsets_mapping=True)
        assert all(0 <= i < len(tok) for i in enc.input_ids)
        assert tok.decode(enc.input_ids) == text
        offsets = enc.offset_mapping
        assert len(offsets) == len(enc.input_ids)
        covered = set()
        previous_start = 0
        for start, end in offsets:
            # A character split over several byte-level tokens gives each of them the whole character's span.
            assert previous_start <= start <= end <= len(text)
            previous_start = start
            covered.update(range(start, end))
        assert covered == set(range(len(text)))


def test_training_produced_useful_merges(tok: PreTrainedTokenizerFast) -> None:
    samples = [
        "The weather today is cloudy with a chance of rain.",
        '{"name": "search", "arguments": {"query": "pizza", "limit": 5}}',
        "def load_config(path: str) -> dict:\n    return json.load(f)",
    ]
    for text in samples:
        assert len(tok.encode(text)) < len(text.encode()) / 2


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "name": "get_weather", "content": '{"temp": 18}'},
    {"role": "tool", "content": "14:03"},
    {"role": "assistant", "content": [{"type": "text", "text": "18 C at 14:03."}]},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You're welcome.", "tool_calls": []},
]


def test_chat_template_renders_every_role(tok: PreTrainedTokenizerFast) -> None:
    rendered = tok.apply_chat_template(CONVERSATION, tokenize=False)
    expected = (
        "<|bos|><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<|tool_call|>{"name": "get_weather", "arguments": {"city": "Paris"}}<|/tool_call|>\n'
        '<|tool_call|>{"name": "get_time", "arguments": {"tz": "CET"}}<|/tool_call|><|im_end|>\n'
        '<|im_start|>tool name=get_weather id=call_0\n{"temp": 18}<|im_end|>\n'
        "<|im_start|>tool\n14:03<|im_end|>\n"
        "<|im_start|>assistant\n18 C at 14:03.<|im_end|>\n"
        "<|im_start|>user\nThanks!<|im_end|>\n"
        "<|im_start|>assistant\nYou're welcome.<|im_end|>"
    )
    assert rendered == expected
    ids = tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert ids[-1] == tok.eos_token_id


def test_chat_template_content_with_tool_calls_and_tools_block(tok: PreTrainedTokenizerFast) -> None:
    call = {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "Calling.", "tool_calls": [call]}]
    rendered = tok.apply_chat_template(messages, tools=tools, tokenize=False)
    assert rendered.startswith("<|bos|><|im_start|>tools\n" + json.dumps(tools) + "<|im_end|>\n<|im_start|>user\n")
    assert rendered.endswith(
        'assistant\nCalling.\n<|tool_call|>{"name": "f", "arguments": {"x": 1}}<|/tool_call|><|im_end|>'
    )
    empty = tok.apply_chat_template([{**messages[1], "content": ""}], tokenize=False)
    assert (
        empty
        == '<|bos|><|im_start|>assistant\n<|tool_call|>{"name": "f", "arguments": {"x": 1}}<|/tool_call|><|im_end|>'
    )


CONVERSATIONS = [
    CONVERSATION,
    CONVERSATION[1:],
    [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": " leading space"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "\n\nleading newlines\n"},
    ],
]


@pytest.mark.parametrize("tools", [None, [{"type": "function", "function": {"name": "f"}}]])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_is_prefix_stable(tok: PreTrainedTokenizerFast, messages: list[dict], tools: list | None) -> None:
    assistant_turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    assert assistant_turns
    for k in assistant_turns:
        prompt = tok.apply_chat_template(messages[:k], tools=tools, add_generation_prompt=True, tokenize=False)
        full = tok.apply_chat_template(messages[: k + 1], tools=tools, tokenize=False)
        assert full.startswith(prompt)
        produced = full[len(prompt) :]
        # What the assistant produced: its content (and tool calls), closed by exactly one end-of-turn token.
        assert produced.endswith(tok.eos_token) and produced.count(tok.eos_token) == 1
        assert "<|im_start|>" not in produced
        # The special tokens around the boundary keep the token ids prefix-stable too.
        prompt_ids = tok.encode(prompt)
        assert tok.encode(full)[: len(prompt_ids)] == prompt_ids
