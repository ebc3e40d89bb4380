"""Synthetic conversation datasets for pipeline tests (deterministic, varied lengths)."""

import json
import random
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
