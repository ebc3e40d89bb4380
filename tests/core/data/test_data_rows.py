"""Row shapes: every accepted layout parses to the normalised form; every bad row names what is wrong."""

import json
from pathlib import Path

import pytest

from layertap.data import Conversation, Preformatted, Pretokenized, iter_rows, parse_row, sample_id_of
from layertap.errors import RowError

MIXED = Path(__file__).parents[2] / "assets" / "datasets" / "mixed.jsonl"


def _reason(row: dict, number: int = 3) -> str:
    with pytest.raises(RowError) as info:
        parse_row(number, row)
    assert info.value.row == number
    assert info.value.sample_id == sample_id_of(number, row)
    return info.value.reason


def test_mixed_file_good_rows_parse_bad_rows_fail_with_reasons():
    outcomes: dict[int, object] = {}
    for number, row in iter_rows(MIXED):
        if isinstance(row, RowError):
            outcomes[number] = row
            continue
        try:
            outcomes[number] = parse_row(number, row)
        except RowError as exc:
            outcomes[number] = exc
    kinds = {n: type(o).__name__ for n, o in outcomes.items()}
    assert kinds == {
        0: "Conversation",
        1: "Conversation",
        2: "Conversation",
        3: "Preformatted",
        4: "Pretokenized",
        5: "Pretokenized",
        6: "Conversation",
        7: "RowError",
        8: "RowError",
        9: "RowError",
        10: "RowError",
        11: "RowError",
        12: "Conversation",
    }
    assert "malformed JSON" in outcomes[7].reason
    assert outcomes[8].reason == "conversation has no assistant turn (roles: system, user)"
    assert outcomes[8].sample_id == "no-assistant"
    assert outcomes[9].reason == "empty text" and outcomes[9].row == 9
    assert outcomes[10].reason.startswith("message 1: unknown role 'narrator'")
    assert str(outcomes[10]).startswith("row 10 (id 'bad-role'): message 1: unknown role 'narrator'")


def test_openai_messages_normalised_with_tools():
    row = json.loads(MIXED.read_text().splitlines()[7])
    conv = parse_row(6, row)
    assert conv == Conversation(
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        "id": "call_1",
                    }
                ],
            },
            {"role": "tool", "content": "sunny, 21C", "tool_call_id": "call_1"},
            {"role": "assistant", "content": "Sunny and 21C."},
        ],
        tools=row["tools"],
    )


def test_sharegpt_aliases_system_field_and_role_dicts():
    conv = parse_row(
        0,
        {
            "system": "Sys.",
            "conversations": [
                {"from": "Human", "value": "a"},
                {"from": "gpt", "value": "b"},
                {"from": "user", "value": "c"},
                {"from": "chatgpt", "value": "d"},
                {"from": "function", "value": "e"},
                {"from": "observation", "value": "f"},
                {"from": "model", "value": "g"},
                {"from": "tool", "value": "h"},
                {"from": "assistant", "value": "i"},
            ],
        },
    )
    assert [(m["role"], m["content"]) for m in conv.messages] == [
        ("system", "Sys."),
        ("user", "a"),
        ("assistant", "b"),
        ("user", "c"),
        ("assistant", "d"),
        ("tool", "e"),
        ("tool", "f"),
        ("assistant", "g"),
        ("tool", "h"),
        ("assistant", "i"),
    ]
    specforge = parse_row(
        0, {"conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}]}
    )
    assert specforge.messages == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}]
    # A row's own system turn is not doubled by a 'system' field.
    own = parse_row(
        0, {"system": "x", "messages": [{"role": "system", "content": "y"}, {"role": "assistant", "content": "z"}]}
    )
    assert [m["content"] for m in own.messages] == ["y", "z"]


def test_arrow_style_rows_with_null_keys():
    row = {
        "id": None,
        "conversation_id": None,
        "text": None,
        "input_ids": None,
        "messages": None,
        "conversations": [
            {"from": "human", "value": "hi", "role": None, "content": None},
            {"from": None, "value": None, "role": "assistant", "content": "yo", "tool_calls": None, "name": None},
        ],
        "tools": None,
    }
    assert sample_id_of(4, row) == "4"
    assert parse_row(4, row) == Conversation(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    )


def test_content_parts_tools_string_and_flat_tool_calls():
    conv = parse_row(
        0,
        {
            "tools": '[{"type": "function", "function": {"name": "f"}}]',
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None, "tool_calls": [{"name": "f", "arguments": {"x": 1}}]},
                {"role": "tool", "content": "1", "name": "f"},
            ],
        },
    )
    assert conv.messages[0]["content"] == "ab"
    assert conv.messages[1]["tool_calls"] == [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]
    assert conv.messages[2] == {"role": "tool", "content": "1", "name": "f"}
    assert conv.tools == [{"type": "function", "function": {"name": "f"}}]


def test_reasoning_is_kept_under_one_name():
    for key in ("reasoning_content", "reasoning", "thinking"):
        conv = parse_row(
            0, {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", key: "r"}]}
        )
        assert conv.messages[1] == {"role": "assistant", "content": "a", "reasoning_content": "r"}


def test_text_and_pretokenized_shapes():
    assert parse_row(0, {"text": "hello"}) == Preformatted("hello")
    assert parse_row(0, {"input_ids": [1, 2], "loss_mask": [0, 1]}) == Pretokenized([1, 2], [0, 1])
    assert parse_row(0, {"input_ids": [1, 2]}) == Pretokenized([1, 2], None)
    # input_ids wins over a conversation stored next to it (the ids are exact).
    both = {"input_ids": [3], "messages": [{"role": "assistant", "content": "x"}]}
    assert parse_row(0, both) == Pretokenized([3], None)


def test_sample_ids():
    assert sample_id_of(5, {"id": 12}) == "12"
    assert sample_id_of(5, {"conversation_id": "c"}) == "c"
    assert sample_id_of(5, {"id": "a", "conversation_id": "c"}) == "a"
    assert sample_id_of(5, {"text": "x"}) == "5"
    for bad, kind, reason in [
        ([1], "row", "'id' must be a string or an integer, got list"),
        (True, "row", "got bool"),
        (float("nan"), "row", "got float"),
        ("a\ud800", "encoding", "'id' at id is not valid UTF-8 text ('\\ud800' at character 1"),
    ]:
        with pytest.raises(RowError) as info:
            sample_id_of(5, {"id": bad, "text": "x"})
        assert (info.value.row, info.value.kind) == (5, kind) and reason in info.value.reason


def test_developer_role_is_the_system_role():
    row = {"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "q"},
                        {"role": "assistant", "content": "a"}]}  # fmt: skip
    assert parse_row(0, row).messages[0] == {"role": "system", "content": "Be brief."}


@pytest.mark.parametrize(
    ("row", "where"),
    [
        ({"text": "ok \udfff"}, "row['text']"),
        ({"messages": [{"role": "user", "content": "q\ud800"}, {"role": "assistant", "content": "a"}]},
         "row['messages'][0]['content']"),
        ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": {"\ud83d": 1}}]}]},
         "a key of row['messages'][0]['tool_calls'][0]['function']['arguments']"),
        ({"tools": [{"name": "f", "description": "\udc80"}], "messages": [{"role": "assistant", "content": "a"}]},
         "row['tools'][0]['description']"),
    ],
)  # fmt: skip
def test_text_that_is_not_utf8_is_an_encoding_error(row: dict, where: str):
    with pytest.raises(RowError) as info:
        parse_row(2, row)
    assert info.value.kind == "encoding" and f"text at {where} is not valid UTF-8" in info.value.reason


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"messages": []}, "empty conversation"),
        ({"messages": "hi"}, "'messages' must be a list of messages, got str"),
        ({"text": ""}, "empty text"),
        ({"text": 3}, "'text' must be a string, got int"),
        ({"messages": [{"role": "user", "content": "q"}, "oops"]}, "message 1 is not an object (got str)"),
        ({"messages": [{"role": "user", "content": 5}]}, "content must be a string or a list of text parts, got int"),
        ({"messages": [{"role": "user", "content": {"a": 1}}]}, "got dict"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
            "content part 0 is not text ('image_url')",
        ),
        ({"messages": [{"role": "user"}]}, "message 0 (user) has no content"),
        ({"messages": [{"content": "q"}]}, "message 0 has neither 'role' nor 'from' (keys: content)"),
        ({"messages": [{"role": "wizard", "content": "q"}]}, "message 0: unknown role 'wizard'"),
        ({"messages": [{"role": 7, "content": "q"}]}, "message 0: unknown role 7"),
        ({"messages": [{"role": "user", "content": "q"}]}, "conversation has no assistant turn (roles: user)"),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]},
            "every assistant turn is empty",
        ),
        ({"messages": [{"role": "assistant"}]}, "message 0 (assistant) has no content, reasoning or tool_calls"),
        (
            {"messages": [{"role": "user", "content": "q", "reasoning_content": "hm"}]},
            "message 0 (user): reasoning must be a string on an assistant turn",
        ),
        (
            {"messages": [{"role": "user", "content": "q", "tool_calls": [{"name": "f"}]}]},
            "only assistant turns may call tools",
        ),
        (
            {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
            "tool call 0 has no function name",
        ),
        ({"messages": [{"role": "assistant", "content": "a", "tool_call_id": 3}]}, "'tool_call_id' must be a string"),
        (
            {"tools": "{not json", "messages": [{"role": "assistant", "content": "a"}]},
            "'tools' is a string but not JSON",
        ),
        ({"input_ids": [1, 2, 3], "loss_mask": [1, 1]}, "loss_mask has 2 values but input_ids has 3"),
        ({"input_ids": [1, "2"]}, "'input_ids'[1] is not an integer (got '2')"),
        ({"input_ids": [1, 2.0]}, "'input_ids'[1] is not an integer (got 2.0)"),
        ({"input_ids": [1, True]}, "'input_ids'[1] is not an integer (got True)"),
        ({"input_ids": [1, -4]}, "'input_ids'[1] is negative (-4)"),
        ({"input_ids": []}, "empty input_ids"),
        ({"input_ids": "1 2"}, "'input_ids' must be a list of integers, got str"),
        ({"input_ids": [1, 2], "loss_mask": [0, 2]}, "'loss_mask'[1] is 2, expected 0 or 1"),
        (
            {"id": "x", "prompt": "a", "completion": "b"},
            "no recognised field: expected one of input_ids, messages, conversations, text; "
            "keys seen: completion, id, prompt",
        ),
    ],
)
def test_bad_rows_have_precise_reasons(row: dict, reason: str):
    assert reason in _reason(row)
