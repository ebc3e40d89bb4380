"""Loss masks on three chat templates, checked independently of how they are computed.

For each template the expected assistant outputs are written out by hand (content or tool-call text plus
the template's end-of-turn marker). The masked tokens, decoded run by run, must be exactly those strings,
in order; every system, user and tool text must sit in unmasked tokens; and the ids must be the plain
tokenisation of the template's own rendering (what the server is sent).
"""

import pytest
import torch
from tokenizers import processors
from transformers import PreTrainedTokenizerFast

from layertap.data import ChatTokenizer, Conversation, Preformatted, Pretokenized, check_loss_mask, parse_row
from layertap.errors import DatasetError, RowError
from layertap.sample import TokenizedSample
from layertap.tiny.tokenizer import build_tokenizer

CALL_ID = "functions.get_weather:0"
ROW = {
    "id": "multi-turn",
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Current weather"}}],
    "messages": [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hi! Ask me about the weather."},
        {"role": "user", "content": "How is Paris today?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": CALL_ID,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": CALL_ID, "content": "sunny, 21 degrees"},
        {"role": "assistant", "content": "Sunny and 21 degrees in Paris."},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "You are welcome.", "reasoning_content": "The user is polite."},
    ],
}
REPLIES = ["Hi! Ask me about the weather.", "Sunny and 21 degrees in Paris.", "You are welcome."]


def _expected(call_text: str, end: str) -> list[str]:
    return [REPLIES[0] + end, call_text + end, REPLIES[1] + end, REPLIES[2] + end]


EXPECTED = {
    "tiny": _expected(
        '<|tool_call|>{"name": "get_weather", "arguments": {"city": "Paris"}}<|/tool_call|>', "<|im_end|>"
    ),
    "llama3": _expected('{"name": "get_weather", "parameters": {"city": "Paris"}}', "<|eot_id|>"),
    "kimi": [
        *_expected(
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>',
            "<|im_end|>",
        )[:3],
        "<think>The user is polite.</think>You are welcome.<|im_end|>",  # only this template renders reasoning
    ],
}


def _runs(tok: PreTrainedTokenizerFast, ids: list[int], mask: list[int], value: int) -> list[str]:
    """Decoded maximal runs of tokens whose mask equals ``value``."""
    runs: list[list[int]] = []
    prev = None
    for i, m in zip(ids, mask, strict=True):
        if m == value:
            if prev != value:
                runs.append([])
            runs[-1].append(i)
        prev = m
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


def _check_mask(tok: PreTrainedTokenizerFast, row: dict, expected: list[str], template: str | None = None) -> None:
    conv = parse_row(0, row)
    sample = ChatTokenizer(tok, chat_template=template).tokenize(0, "s", conv, max_length=None, overlong="skip")
    ids, mask = sample.input_ids.tolist(), sample.loss_mask.tolist()
    assert sample.input_ids.dtype == torch.long and sample.loss_mask.dtype == torch.uint8
    assert not sample.truncated and sample.index == 0 and sample.sample_id == "s"

    rendered = tok.apply_chat_template(
        conv.messages, tools=conv.tools, chat_template=template, tokenize=False, add_generation_prompt=False
    )
    assert ids == tok(rendered, add_special_tokens=False)["input_ids"]
    assert _runs(tok, ids, mask, 1) == expected
    unmasked = _runs(tok, ids, mask, 0)
    for text in (m["content"] for m in conv.messages if m["role"] != "assistant"):
        assert any(text in run for run in unmasked), text
    check_loss_mask(conv, sample)  # a good mask passes the guard


@pytest.mark.parametrize("name", ["tiny", "llama3", "kimi"])
def test_multi_turn_mask_with_system_tools_and_tool_turns(name: str, request: pytest.FixtureRequest):
    tok = request.getfixturevalue(f"{name}_tokenizer")
    _check_mask(tok, ROW, EXPECTED[name])


def test_kimi_default_system_prompt_and_sharegpt_row(kimi_tokenizer: PreTrainedTokenizerFast):
    row = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello, human."}]}
    _check_mask(kimi_tokenizer, row, ["Hello, human.<|im_end|>"])
    text = ChatTokenizer(kimi_tokenizer).render(parse_row(0, row), row_number=0, sample_id=None).text
    assert "You are Kimi" in text  # the injected system prompt is there, and unmasked (checked above)


def test_llama3_consecutive_assistant_turns_and_assistant_first(llama3_tokenizer: PreTrainedTokenizerFast):
    row = {
        "messages": [
            {"role": "assistant", "content": "I speak first."},
            {"role": "assistant", "content": "And again."},
            {"role": "user", "content": "ok"},
        ]
    }
    _check_mask(llama3_tokenizer, row, ["I speak first.<|eot_id|>", "And again.<|eot_id|>"])


def test_separator_after_end_of_turn_is_not_masked(tiny_tokenizer: PreTrainedTokenizerFast):
    """Qwen-style ChatML ends every turn with "<|im_end|>\\n": the newline is scaffolding, never generated."""
    template = (
        "{%- for m in messages -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    )
    row = {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Line one.\n"},
            {"role": "user", "content": "More"},
            {"role": "assistant", "content": "Done."},
        ]
    }
    _check_mask(tiny_tokenizer, row, ["Line one.\n<|im_end|>", "Done.<|im_end|>"], template=template)


def test_mask_survives_trimmed_offsets():
    """GPT-2-style tokenizers trim whitespace out of offsets (whitespace tokens become zero-width)."""
    tok = build_tokenizer()
    tok.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    reply = "Two  spaces,\n\n  indented   line  "
    row = {"messages": [{"role": "user", "content": "a  b \n "}, {"role": "assistant", "content": reply}]}
    _check_mask(tok, row, [reply + "<|im_end|>"])
    # A generation prompt ending in a space that stays its own token: trimmed to zero width at the span start.
    spaced = (
        "{%- for m in messages -%}{{ m.role + ': ' + m.content + '<|im_end|>' }}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ 'assistant: ' }}{%- endif -%}"
    )
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\nHello"}]}
    _check_mask(tok, row, ["\nHello<|im_end|>"], template=spaced)


def test_template_override_string(tiny_tokenizer: PreTrainedTokenizerFast, llama3_tokenizer):
    # The tiny tokenizer's own template is ChatML; the override renders Llama-3 style instead.
    template = llama3_tokenizer.chat_template
    tok = build_tokenizer()
    tok.add_tokens(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], special_tokens=True)
    assert ChatTokenizer(tok, chat_template=template).chat_template == template
    assert ChatTokenizer(tiny_tokenizer).chat_template == tiny_tokenizer.chat_template
    _check_mask(tok, ROW, EXPECTED["llama3"], template=template)


# Templates that break masking, each in a different way.
ASSISTANT_ONLY = (
    "{%- for m in messages -%}{%- if m.role == 'assistant' -%}{{ m.content + '<|im_end|>' }}{%- endif -%}{%- endfor -%}"
)
DROPS_ASSISTANT = (
    "{%- for m in messages -%}{%- if m.role != 'assistant' -%}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>' }}{%- endif -%}{%- endfor -%}"
)
COUNTS_TURNS = (
    "{{ '<|im_start|>turns=' + (messages | length | string) + '<|im_end|>' }}"
    "{%- for m in messages -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
THINK_PROMPT = (
    "{%- for m in messages -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
)
SIMPLE = {"id": "s1", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}


@pytest.mark.parametrize(("template", "kind"), [(ASSISTANT_ONLY, "all 1"), (DROPS_ASSISTANT, "all 0")])
def test_a_template_that_masks_a_plain_chat_all_one_or_all_zero_stops_the_run(tiny_tokenizer, template, kind):
    ct = ChatTokenizer(tiny_tokenizer, chat_template=template)
    with pytest.raises(DatasetError, match=rf"plain user/assistant chat a loss mask that is {kind}.*chat template"):
        ct.tokenize(4, "s1", parse_row(4, SIMPLE), max_length=None, overlong="skip")
    assert ct.tokenize(5, "t", Preformatted("Hi"), max_length=None, overlong="skip").num_tokens > 0  # no template


def test_a_degenerate_mask_on_one_row_is_that_rows_error(tiny_tokenizer):
    """A template that drops some assistant turns (here: the ones marked hidden) fails only those rows."""
    hides = (
        "{%- for m in messages -%}{{ '<|im_start|>' + m.role + '\\n' }}"
        "{%- if not m.content.startswith('(hidden)') -%}{{ m.content + '<|im_end|>' }}{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    )
    ct = ChatTokenizer(tiny_tokenizer, chat_template=hides)
    good = parse_row(3, SIMPLE)
    check_loss_mask(good, ct.tokenize(3, "s1", good, max_length=None, overlong="skip"))
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "(hidden) yes"}]}
    hidden = parse_row(4, row)
    with pytest.raises(RowError, match=r"loss mask is all 0.*this row's assistant turns") as info:
        check_loss_mask(hidden, ct.tokenize(4, "s2", hidden, max_length=None, overlong="skip"))
    assert (info.value.row, info.value.sample_id, info.value.kind) == (4, "s2", "loss_mask")


def test_guard_ignores_rows_without_roles():
    all_one = TokenizedSample("t", 0, torch.tensor([5, 6, 7]), torch.ones(3, dtype=torch.uint8))
    check_loss_mask(Preformatted("<|im_start|>user\nHi<|im_end|>"), all_one)  # all 1 by design
    check_loss_mask(parse_row(0, {"messages": [{"role": "assistant", "content": "Alone"}]}), all_one)


def test_template_whose_generation_prompt_does_not_begin_the_turn_is_a_row_error(tiny_tokenizer):
    """A prompt ending in an empty thinking block the turn's rendering never shows: the turn cannot be located."""
    ct = ChatTokenizer(tiny_tokenizer, chat_template=THINK_PROMPT)
    with pytest.raises(RowError, match="not prefix-stable") as info:
        ct.tokenize(9, "s1", parse_row(9, SIMPLE), max_length=None, overlong="skip")
    assert (info.value.row, info.value.sample_id, info.value.kind) == (9, "s1", "template")


def test_template_that_rewrites_what_came_before_gives_the_last_turn_as_the_target_saw_it(tiny_tokenizer):
    """A header counting the turns renders otherwise once a turn follows: the sample is the prompt the assistant was
    given (its header counts 1) and the turn after it, not the whole rendering (whose header counts 2)."""
    ct = ChatTokenizer(tiny_tokenizer, chat_template=COUNTS_TURNS)
    conv = parse_row(9, SIMPLE)
    sample = ct.tokenize(9, "s1", conv, max_length=None, overlong="skip")
    prompt = tiny_tokenizer.apply_chat_template(conv.messages[:1], chat_template=COUNTS_TURNS, tokenize=False,
                                                add_generation_prompt=True)  # fmt: skip
    assert "turns=1" in prompt
    ids = sample.input_ids.tolist()
    assert ids == tiny_tokenizer(prompt + "Hello<|im_end|>", add_special_tokens=False)["input_ids"]
    assert _runs(tiny_tokenizer, ids, sample.loss_mask.tolist(), 1) == ["Hello<|im_end|>"]


def test_template_exception_is_a_row_error(tiny_tokenizer):
    ct = ChatTokenizer(tiny_tokenizer, chat_template="{{ raise_exception('tools are not supported') }}")
    with pytest.raises(RowError, match=r"chat template failed.*tools are not supported"):
        ct.tokenize(0, "s1", parse_row(0, SIMPLE), max_length=None, overlong="skip")


def test_missing_chat_template_only_matters_for_conversations():
    tok = build_tokenizer()
    tok.chat_template = None
    ct = ChatTokenizer(tok)
    assert ct.chat_template is None
    assert ct.tokenize(0, "t", Preformatted("Hi there"), max_length=None, overlong="skip").num_tokens > 0
    with pytest.raises(DatasetError, match="no chat template"):
        ct.tokenize(0, "s1", parse_row(0, SIMPLE), max_length=None, overlong="skip")


def test_preformatted_and_pretokenized(tiny_tokenizer):
    ct = ChatTokenizer(tiny_tokenizer)
    text = "<|bos|><|im_start|>user\nPing<|im_end|>\n<|im_start|>assistant\nPong<|im_end|>"
    sample = ct.tokenize(3, "p", Preformatted(text), max_length=None, overlong="skip")
    assert sample.input_ids.tolist() == tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tiny_tokenizer.decode(sample.input_ids.tolist()) == text  # BOS rendered once, not added again
    assert bool(sample.loss_mask.all())

    given = ct.tokenize(4, "q", Pretokenized([5, 6, 7], [0, 1, 1]), max_length=None, overlong="skip")
    assert given.input_ids.tolist() == [5, 6, 7] and given.loss_mask.tolist() == [0, 1, 1]
    default = ct.tokenize(4, "q", Pretokenized([5, 6]), max_length=None, overlong="skip")
    assert default.loss_mask.tolist() == [1, 1]
    vocab = len(tiny_tokenizer)
    with pytest.raises(RowError, match=rf"id {vocab}, outside the tokenizer's vocabulary \[0, {vocab}\)"):
        ct.tokenize(4, "q", Pretokenized([1, vocab]), max_length=None, overlong="skip")


def test_truncate_and_skip(tiny_tokenizer):
    ct = ChatTokenizer(tiny_tokenizer)
    conv = parse_row(0, ROW)
    full = ct.tokenize(0, "m", conv, max_length=None, overlong="skip")
    n = full.num_tokens
    assert ct.tokenize(0, "m", conv, max_length=n, overlong="skip").num_tokens == n

    cut = ct.tokenize(0, "m", conv, max_length=n - 5, overlong="truncate")
    assert cut.truncated and cut.num_tokens == n - 5
    assert torch.equal(cut.input_ids, full.input_ids[: n - 5]) and torch.equal(cut.loss_mask, full.loss_mask[: n - 5])
    with pytest.raises(RowError, match=rf"longer than max_length \({n} > {n - 5} tokens\)"):
        ct.tokenize(0, "m", conv, max_length=n - 5, overlong="skip")

    first_one = int(full.loss_mask.nonzero()[0])
    with pytest.raises(RowError, match=f"no assistant token left after truncation to max_length={first_one}"):
        ct.tokenize(0, "m", conv, max_length=first_one, overlong="truncate")
    assert ct.tokenize(0, "m", conv, max_length=first_one + 1, overlong="truncate").loss_mask.sum() == 1

    pre = ct.tokenize(0, "p", Pretokenized([1, 2, 3, 4], [1, 0, 0, 1]), max_length=3, overlong="truncate")
    assert pre.input_ids.tolist() == [1, 2, 3] and pre.loss_mask.tolist() == [1, 0, 0] and pre.truncated


def test_conversation_dataclass_roles():
    conv = Conversation([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    assert conv.has_role("user") and conv.has_role("assistant") and not conv.has_role("tool")


def test_what_the_tokenizer_raises_is_that_rows_error(tiny_tokenizer):
    """parse_row refuses lone surrogates first (kind encoding); the tokenizer's own refusal is the net under it."""
    with pytest.raises(RowError, match=r"tokenizer failed: TypeError") as info:
        ChatTokenizer(tiny_tokenizer).tokenize(6, "t", Preformatted("a \ud800 b"), max_length=None, overlong="skip")
    assert (info.value.row, info.value.sample_id, info.value.kind) == (6, "t", "tokenizer")
