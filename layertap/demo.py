"""``layertap demo``: the whole path on a tiny model, no GPU, in well under a minute."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from layertap.spec import ExtractionSpec

_TOPICS = [
    ("the water cycle", "Water evaporates, condenses into clouds and falls again as rain or snow."),
    ("binary search", "Compare with the middle element and keep the half that can still hold the target."),
    ("photosynthesis", "Plants turn light, water and carbon dioxide into sugar and oxygen."),
    ("TCP handshakes", "SYN, SYN-ACK, ACK: both sides agree on sequence numbers before sending data."),
    ("sourdough bread", "A starter of wild yeast leavens the dough slowly, which gives the sour taste."),
    ("the French Revolution", "It began in 1789 and ended the absolute monarchy in France."),
    ("hash tables", "Keys are hashed to buckets, so lookups take constant time on average."),
    ("black holes", "Matter so dense that not even light escapes past the event horizon."),
]


def demo_rows() -> list[dict]:
    """A small, fixed conversation set covering ShareGPT and OpenAI shapes, system prompts and tools."""
    rows: list[dict] = []
    for i, (topic, answer) in enumerate(_TOPICS):
        rows.append(
            {
                "id": f"sharegpt-{i}",
                "conversations": [
                    {"from": "human", "value": f"Can you explain {topic}?"},
                    {"from": "gpt", "value": answer},
                    {"from": "human", "value": "Give me one more detail, please."},
                    {"from": "gpt", "value": f"More on {topic}: " + answer.lower() * (1 + i % 3)},
                ],
            }
        )
        rows.append(
            {
                "id": f"openai-{i}",
                "messages": [
                    {"role": "system", "content": "You are a concise tutor."},
                    {"role": "user", "content": f"Summarise {topic} in one sentence."},
                    {"role": "assistant", "content": answer},
                ],
            }
        )
        rows.append(
            {
                "id": f"tools-{i}",
                "messages": [
                    {"role": "system", "content": "You can call tools."},
                    {"role": "user", "content": f"Look up {topic} and tell me."},
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [
                            {"type": "function", "function": {"name": "search", "arguments": {"query": topic}}}
                        ],
                    },
                    {"role": "tool", "content": json.dumps({"result": answer})},
                    {"role": "assistant", "content": f"According to the search: {answer}"},
                ],
            }
        )
    return rows


def run_demo(out: Path, fmt: str, console: Console) -> bool:
    """Build the tiny model and data under ``out``, extract, verify, and print what was produced; whether the
    store verified clean."""
    from layertap.engines.factory import hf_engine_factory
    from layertap.pipeline import run_extraction
    from layertap.progress import RichProgress
    from layertap.settings import RunSettings
    from layertap.store.store import OutputStore
    from layertap.tiny.build import build_tiny_model
    from layertap.verify import verify_store

    out.mkdir(parents=True, exist_ok=True)
    model = out / "model"
    if not (model / "config.json").exists():
        build_tiny_model("llama", model)
    data = out / "conversations.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in demo_rows()))
    states = out / f"states-{fmt}"
    spec = ExtractionSpec(model=model, data=data, layers=(1, 3, 5), format=fmt)  # type: ignore[arg-type]
    progress = RichProgress(console)
    try:
        report = run_extraction(spec, states, hf_engine_factory(RunSettings(device="cpu")), progress=progress)
    finally:
        progress.stop()
    check = verify_store(states)
    store = OutputStore.open_existing(states)
    first = min(store.records().values(), key=lambda r: r.index)
    tensors = store.format.load(states / first.file)

    table = Table(title=f"layertap demo ({fmt})", show_header=False)
    table.add_row("output", str(states.resolve()))
    table.add_row("samples", f"{check.samples} ({len(report.computed)} computed now, {report.already_done} resumed)")
    table.add_row("tokens / bytes", f"{check.tokens:,} / {check.nbytes:,}")
    table.add_row("capture indices", f"{store.manifest.capture_indices} (input of decoder layer i)")
    table.add_row("final state", "post-norm" if store.manifest.final_post_norm else "pre-norm")
    table.add_row(f"sample {first.file}", ", ".join(f"{k} {tuple(v.shape)} {v.dtype}" for k, v in tensors.items()))
    table.add_row("verify", "clean" if check.ok else f"{len(check.problems)} problems: {check.problems[:3]}")
    Console().print(table)
    return check.ok
