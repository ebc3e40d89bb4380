"""Parse a raw dataset row into one of three shapes the tokeniser understands.

Accepted rows (fields are tried in this order, a ``None`` value counts as absent):

- ``input_ids`` (+ optional ``loss_mask``): already tokenised; taken as exact, so it wins.
- ``messages``: OpenAI style ``{role, content, [tool_calls], [tool_call_id], [name]}``.
- ``conversations``: ShareGPT ``{from, value}`` (or role/content dicts, as SpecForge writes).
- ``text``: one preformatted string (the chat template already applied).

Optional row fields: ``id``/``conversation_id`` (the sample id: a string or an integer), ``system``
(a system prompt put first, as LLaMA-Factory's ShareGPT rows carry it) and ``tools`` (tool schemas
for the template). Every problem raises ``RowError`` naming the row, the sample id, its kind and
exactly what is wrong; text the tokenizer could not take (lone surrogates) is kind ``encoding``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from layertap.errors import RowError

ID_FIELDS: tuple[str, ...] = ("id", "conversation_id")
SHAPE_FIELDS: tuple[str, ...] = ("input_ids", "messages", "conversations", "text")

# Names for an assistant's reasoning (thinking models); kept as ``reasoning_content`` for the template.
REASONING_FIELDS: tuple[str, ...] = ("reasoning_content", "reasoning", "thinking")

Fail = Callable[[str], RowError]

# ShareGPT speakers and OpenAI roles, matched case-insensitively.
ROLE_ALIASES: dict[str, str] = {
    "system": "system",
    "developer": "system",  # newer OpenAI chats' name for the system role
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}


@dataclass(frozen=True, slots=True)
class Conversation:
    """Messages normalised to ``{role, content: str, [tool_calls], [tool_call_id], [name], [reasoning_content]}``.

    ``role`` is one of system/user/assistant/tool; ``tool_calls`` (assistant only) is a list of
    ``{"type": "function", "function": {"name", "arguments"}, ["id"]}``.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None

    def has_role(self, role: str) -> bool:
        return any(m["role"] == role for m in self.messages)


@dataclass(frozen=True, slots=True)
class Preformatted:
    """Text with the chat template already applied (roles cannot be told apart any more)."""

    text: str


@dataclass(frozen=True, slots=True)
class Pretokenized:
    """Token ids as given; ``loss_mask`` (same length, 0/1) or None for all 1."""

    input_ids: list[int]
    loss_mask: list[int] | None = None


ParsedRow = Conversation | Preformatted | Pretokenized


def sample_id_of(row_number: int, row: dict[str, Any]) -> str:
    """The row's ``id`` or ``conversation_id`` (stringified), else its row number as a string.

    Raises RowError when the id is neither a string nor an integer, or is not valid UTF-8: it names
    the sample in every record, so it must survive JSON, Redis and a terminal unchanged.
    """
    for key in ID_FIELDS:
        value = row.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise RowError(f"'{key}' must be a string or an integer, got {type(value).__name__}", row=row_number)
        if (where := unencodable(value, key)) is not None:
            raise RowError(f"'{key}' {where}", row=row_number, kind="encoding")
        return str(value)
    return str(row_number)


def unencodable(value: Any, path: str) -> str | None:
    """Where the first string in ``value`` (nested lists and dicts, keys too) that is not valid UTF-8 is,
    or None. Walks with a stack: rows can be nested deeper than Python's recursion limit."""
    stack: list[tuple[str, Any]] = [(path, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                bad = item[exc.start : exc.end]
                return f"at {where} is not valid UTF-8 text ({bad!r} at character {exc.start}: a lone surrogate)"
        elif isinstance(item, dict):
            for k, v in reversed(item.items()):
                stack += [(f"{where}[{k!r}]", v), (f"a key of {where}", k)]
        elif isinstance(item, list | tuple):
            stack += [(f"{where}[{i}]", v) for i, v in reversed(list(enumerate(item)))]
    return None


def parse_row(row_number: int, row: dict[str, Any]) -> ParsedRow:
    """Turn a row dict into a Conversation, Preformatted or Pretokenized; raise RowError if unusable."""
    sid = sample_id_of(row_number, row)

    def fail(reason: str) -> RowError:
        return RowError(reason, row=row_number, sample_id=sid)

    parsed = _parse(row, fail)
    text: dict[str, Any] = {}  # what reaches the template and the tokenizer
    if isinstance(parsed, Preformatted):
        text = {"text": parsed.text}
    elif isinstance(parsed, Conversation):
        text = {"messages": parsed.messages, "tools": parsed.tools}
    if (where := unencodable(text, "row")) is not None:
        raise RowError(f"text {where}; the tokenizer cannot take it", row=row_number, sample_id=sid, kind="encoding")
    return parsed


def _parse(row: dict[str, Any], fail: Fail) -> ParsedRow:
    if row.get("input_ids") is not None:
        return _pretokenized(row["input_ids"], row.get("loss_mask"), fail)
    for key in ("messages", "conversations"):
        if row.get(key) is not None:
            return _conversation(key, row[key], row.get("system"), row.get("tools"), fail)
    if row.get("text") is not None:
        text = row["text"]
        if not isinstance(text, str):
            raise fail(f"'text' must be a string, got {type(text).__name__}")
        if not text.strip():
            raise fail("empty text")
        return Preformatted(text)
    keys = ", ".join(sorted(map(str, row))) or "none"
    raise fail(f"no recognised field: expected one of {', '.join(SHAPE_FIELDS)}; keys seen: {keys}")


def _int_list(name: str, value: Any, fail: Fail) -> list[int]:
    if not isinstance(value, list):
        raise fail(f"'{name}' must be a list of integers, got {type(value).__name__}")
    for i, v in enumerate(value):
        # bool is an int subclass; True in a token list is a bug in the data, not a token.
        if not isinstance(v, int) or isinstance(v, bool):
            raise fail(f"'{name}'[{i}] is not an integer (got {v!r})")
    return value


def _pretokenized(ids: Any, mask: Any, fail: Fail) -> Pretokenized:
    input_ids = _int_list("input_ids", ids, fail)
    if not input_ids:
        raise fail("empty input_ids")
    if (neg := next((i for i, v in enumerate(input_ids) if v < 0), None)) is not None:
        raise fail(f"'input_ids'[{neg}] is negative ({input_ids[neg]})")
    if mask is None:
        return Pretokenized(input_ids)
    loss_mask = _int_list("loss_mask", mask, fail)
    if len(loss_mask) != len(input_ids):
        raise fail(f"loss_mask has {len(loss_mask)} values but input_ids has {len(input_ids)}")
    if (bad := next((i for i, v in enumerate(loss_mask) if v not in (0, 1)), None)) is not None:
        raise fail(f"'loss_mask'[{bad}] is {loss_mask[bad]}, expected 0 or 1")
    return Pretokenized(input_ids, loss_mask)


def _conversation(key: str, raw: Any, system: Any, tools: Any, fail: Fail) -> Conversation:
    if not isinstance(raw, list):
        raise fail(f"'{key}' must be a list of messages, got {type(raw).__name__}")
    if not raw:
        raise fail("empty conversation")
    messages = [_message(i, m, fail) for i, m in enumerate(raw)]
    if isinstance(system, str) and system.strip() and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    assistants = [m for m in messages if m["role"] == "assistant"]
    if not assistants:
        roles = ", ".join(m["role"] for m in messages)
        raise fail(f"conversation has no assistant turn (roles: {roles})")
    if not any(m["content"] or m.get("tool_calls") or m.get("reasoning_content") for m in assistants):
        raise fail("every assistant turn is empty (no content, reasoning or tool calls)")
    return Conversation(messages, _tools(tools, fail))


def _message(i: int, raw: Any, fail: Fail) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise fail(f"message {i} is not an object (got {type(raw).__name__})")
    # Arrow stores a list of structs with the union of all keys, so absent keys come back as None.
    if raw.get("from") is not None:
        who, content = raw["from"], raw.get("value", raw.get("content"))
    elif raw.get("role") is not None:
        who, content = raw["role"], raw.get("content")
    else:
        keys = ", ".join(sorted(k for k, v in raw.items() if v is not None)) or "none"
        raise fail(f"message {i} has neither 'role' nor 'from' (keys: {keys})")
    role = ROLE_ALIASES.get(who.strip().lower()) if isinstance(who, str) else None
    if role is None:
        raise fail(f"message {i}: unknown role {who!r} (known: {', '.join(ROLE_ALIASES)})")

    msg: dict[str, Any] = {"role": role, "content": _content(i, role, content, fail)}
    calls = raw.get("tool_calls")
    if calls:
        if role != "assistant":
            raise fail(f"message {i} ({role}) has tool_calls; only assistant turns may call tools")
        msg["tool_calls"] = [_tool_call(i, j, c, fail) for j, c in enumerate(_listify(calls, i, fail))]
    reasoning = next((raw[k] for k in REASONING_FIELDS if raw.get(k) is not None), None)
    if reasoning is not None:
        if role != "assistant" or not isinstance(reasoning, str):
            raise fail(f"message {i} ({role}): reasoning must be a string on an assistant turn")
        msg["reasoning_content"] = reasoning
    if content is None and role == "assistant" and not calls and reasoning is None:
        raise fail(f"message {i} (assistant) has no content, reasoning or tool_calls")
    for field in ("tool_call_id", "name"):
        if raw.get(field) is not None:
            if not isinstance(raw[field], str):
                raise fail(f"message {i}: '{field}' must be a string, got {type(raw[field]).__name__}")
            msg[field] = raw[field]
    return msg


def _content(i: int, role: str, content: Any, fail: Fail) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        if role == "assistant":  # a pure tool-call or reasoning turn; checked by the caller
            return ""
        raise fail(f"message {i} ({role}) has no content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise fail(f"message {i} ({role}): content part {j} is not text ({kind!r}); only text is supported")
            texts.append(part["text"])
        return "".join(texts)
    raise fail(f"message {i} ({role}): content must be a string or a list of text parts, got {type(content).__name__}")


def _listify(calls: Any, i: int, fail: Fail) -> list[Any]:
    if isinstance(calls, str):  # some exports store tool calls as a JSON string
        try:
            calls = json.loads(calls)
        except ValueError as exc:
            raise fail(f"message {i}: tool_calls is a string but not JSON: {exc}") from exc
    if not isinstance(calls, list):
        raise fail(f"message {i}: tool_calls must be a list, got {type(calls).__name__}")
    return calls


def _tool_call(i: int, j: int, raw: Any, fail: Fail) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise fail(f"message {i}: tool call {j} is not an object (got {type(raw).__name__})")
    fn = raw.get("function") if raw.get("function") is not None else raw  # flat {name, arguments} too
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise fail(f"message {i}: tool call {j} has no function name")
    args = fn.get("arguments")
    args = "{}" if args is None else args
    if not isinstance(args, str | dict):
        raise fail(f"message {i}: tool call {j} arguments must be a JSON string or an object")
    call: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if raw.get("id") is not None:
        call["id"] = str(raw["id"])
    return call


def _tools(tools: Any, fail: Fail) -> list[dict[str, Any]] | None:
    if tools is None or tools == "" or tools == []:
        return None
    if isinstance(tools, str):  # LLaMA-Factory stores the tool schemas as a JSON string
        try:
            tools = json.loads(tools)
        except ValueError as exc:
            raise fail(f"'tools' is a string but not JSON: {exc}") from exc
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise fail("'tools' must be a list of tool schemas (objects)")
    return tools
