"""Synthetic conversation datasets for pipeline tests (deterministic, varied lengths)."""

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

WORDS = [
    "the",
    "a",
    "model",
    "layer",
    "token",
    "state",
    "drafter",
    "cache",
    "prefill",
    "batch",
    "request",
    "server",
    "shard",
    "commit",
    "verify",
]


def conversation_rows(n: int, *, seed: int = 0, max_words: int = 60) -> list[dict]:
    """``n`` OpenAI-style conversations (some with a system prompt, some multi-turn) with unique ids."""
    rng = random.Random(seed)

    def text() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words)))

    rows = []
    for i in range(n):
        messages = [{"role": "system", "content": text()}] if i % 3 == 0 else []
        for _ in range(1 + i % 2):
            messages += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
        rows.append({"id": f"conv-{i}", "messages": messages})
    return rows


def write_jsonl(path: Path, rows: list, raw_lines: dict[int, str] | None = None) -> Path:
    """Write rows as JSONL; ``raw_lines`` puts verbatim (e.g. malformed) lines at given positions."""
    raw_lines = raw_lines or {}
    lines = [json.dumps(r) for r in rows]
    for pos in sorted(raw_lines):
        lines.insert(pos, raw_lines[pos])
    path.write_text("\n".join(lines) + "\n")
    return path


# A chat template that refuses what some real ones refuse (Mistral's, Gemma's): two user turns in a row.
ALTERNATION_CHECK = (
    "{%- for m in messages -%}{%- if not loop.first and m.role == 'user' and loop.previtem.role == 'user' -%}"
    "{{- raise_exception('Conversation roles must alternate user/assistant') -}}{%- endif -%}{%- endfor -%}"
)


def strict_template_model(model: Path, dest: Path) -> Path:
    """A copy of ``model`` whose chat template raises on two consecutive user turns."""
    shutil.copytree(model, dest)
    template = dest / "chat_template.jinja"
    template.write_text(ALTERNATION_CHECK + template.read_text())
    return dest


@dataclass(frozen=True)
class MalformedSet:
    """A JSONL file mixing good rows with every kind of bad row, and what a run must make of each."""

    data: Path
    kinds: dict[int, str]  # row -> the kind of its error
    good: dict[str, int]  # sample id -> row, for the rows that must be stored
    max_length: int = 512  # rows longer than this are skipped ("overlong")


def malformed_dataset(path: Path) -> MalformedSet:
    """Good rows of every shape, and one bad row of each kind; ``kinds``/``good`` say what a run must report."""

    def chat(*turns: str) -> list[dict]:
        return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]

    tools_row = {
        "id": "good-tools",
        "messages": [
            {"role": "developer", "content": "Answer with tools."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "assistant", "content": "It is sunny."},
        ],
        "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}],
    }  # fmt: skip
    deep = "[" * 20_000 + "]" * 20_000
    lines: list[tuple[bytes, str | None]] = [
        (_j({"id": "good-openai", "messages": chat("Hi there", "Hello, how can I help?")}), None),
        (_j({"id": "good-sharegpt", "system": "Be nice.",
             "conversations": [{"from": "human", "value": "a joke"}, {"from": "gpt", "value": "no"}]}), None),
        (_j(tools_row), None),
        (_j({"id": "good-text", "text": "the model layer state and the drafter cache"}), None),
        (_j({"id": "good-ids", "input_ids": [1, 40, 50, 60, 70], "loss_mask": [0, 0, 1, 1, 1]}), None),
        (_j({"id": "good-extra", "meta": {"score": float("nan"), "tags": [None, {}]}, "messages": chat("q", "a")}),
         None),
        (b'{"id": "broken", "messages": [', "row"),
        (b"[1, 2]", "row"),
        (_j({"id": "good-openai", "messages": chat("same id", "as row 0")}), "duplicate_id"),
        (_j({"id": "surrogate-text", "messages": chat("lone \ud800 surrogate", "a")}), "encoding"),
        (_j({"id": "surrogate-id-\udfff", "text": "fine text"}), "encoding"),
        (_j({"id": ["a", "list"], "text": "fine text"}), "row"),
        (_j({"id": "int-content", "messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "a"}]}),
         "row"),
        (_j({"id": "no-fields", "prompt": "p"}), "row"),
        (_j({"id": "bad-role", "messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "yo"}]}),
         "row"),
        (_j({"id": "empty-text", "text": ""}), "row"),
        (_j({"id": "huge", "messages": chat("drafter " * 30_000, "ok")}), "overlong"),
        (b'{"id": "deep", "messages": ' + deep.encode() + b"}", "row"),
        (_j({"id": "nan-content", "messages": [{"role": "user", "content": float("nan")},
                                                {"role": "assistant", "content": "a"}]}), "row"),
        (b'{"id": "latin-1", "text": "caf\xe9"}', "row"),
        (_j({"id": "out-of-vocab", "input_ids": [1, 99_999]}), "row"),
        (_j({"id": "two-users", "messages": chat("one", "two")[:1] * 2 + chat("x", "answer")[1:]}), "template"),
        (_j({"id": "good-last", "messages": chat("last", "one")}), None),
    ]  # fmt: skip
    path.write_bytes(b"\n".join(line for line, _ in lines) + b"\n")
    kinds = {n: kind for n, (_, kind) in enumerate(lines) if kind is not None}
    good = {json.loads(line)["id"]: n for n, (line, kind) in enumerate(lines) if kind is None}
    return MalformedSet(path, kinds, good)


def _j(row: dict) -> bytes:
    return json.dumps(row).encode()
