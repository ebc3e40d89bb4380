"""Property-based: rows of every supported shape, in every file format, mutated at random, through the
reader, the row parser, the chat template and the tiny model into a store.

Whatever the rows: the run ends normally; each bad row is reported once, with the kind its mutation
calls for; each good row is stored once; every row is either stored or reported. Mutations whose
outcome cannot be told in advance (a random value put anywhere, a random key removed) must still be
stored or reported once, never with kind ``internal`` (an exception the row code did not expect).

Deterministic for CI (the "layertap" hypothesis profile in tests/conftest.py: derandomized, no example
database; a fixed budget here): a failure reproduces by running the same test again; hypothesis prints
the failing rows.
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from layertap.engines.base import Engine
from layertap.engines.factory import EngineFactory
from layertap.errors import ROW_KINDS
from layertap.models.folder import ModelFolder
from layertap.pipeline import run_extraction
from layertap.spec import CaptureSpec, ExtractionSpec
from layertap.store.index import ERRORS_DIR, INDEX_DIR, read_jsonl_dir
from layertap.store.store import OutputStore
from tests.hf_engines import cpu_hf

MAX_LENGTH = 1024
HUGE = "drafter " * 4000  # far over MAX_LENGTH tokens
DEEP = b"[" * 20_000 + b"]" * 20_000  # deeper than any JSON parser recurses
UNKNOWN = "?"  # the outcome of a mutation that cannot be told in advance

TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12).filter(str.strip)
NAME = st.from_regex(r"[a-z_]{1,8}", fullmatch=True)
ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


# --- rows of every shape ----------------------------------------------------------------------------


@st.composite
def sharegpt_row(draw: st.DrawFn) -> dict:
    turns = [t for _ in range(draw(st.integers(1, 2))) for t in ({"from": "human"}, {"from": "gpt"})]
    row = {"conversations": [{**t, "value": draw(TEXT)} for t in turns]}
    if draw(st.booleans()):
        row["system"] = draw(TEXT)
    return row


@st.composite
def openai_tools_row(draw: st.DrawFn) -> dict:
    name = draw(NAME)
    args = draw(st.dictionaries(NAME, st.integers(-9, 9) | TEXT | st.booleans(), max_size=2))
    messages = [{"role": "system", "content": draw(TEXT)}] if draw(st.booleans()) else []
    messages += [
        {"role": "user", "content": draw(TEXT)},
        {"role": "assistant", "content": draw(st.none() | TEXT), "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": "c1", "content": draw(TEXT)},
        {"role": "assistant", "content": draw(TEXT)},
    ]  # fmt: skip
    tool = {"type": "function", "function": {"name": name, "description": draw(TEXT),
                                               "parameters": {"type": "object", "required": sorted(args)}}}  # fmt: skip
    return {"messages": messages, "tools": [tool]}


@st.composite
def pretokenized_row(draw: st.DrawFn, vocab: int) -> dict:
    ids = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=16))
    row: dict[str, Any] = {"input_ids": ids}
    if draw(st.booleans()):
        row["loss_mask"] = draw(st.lists(st.integers(0, 1), min_size=len(ids), max_size=len(ids)))
    return row


def any_row(vocab: int) -> st.SearchStrategy[dict]:
    return st.one_of(sharegpt_row(), openai_tools_row(), st.builds(dict, text=TEXT), pretokenized_row(vocab))


# --- mutations: (what it does to the row, the kind of error it must give; None = still good) ----------

ROW_FORMATS = ("jsonl", "json", "parquet")
# Parquet columns are typed and its strings are UTF-8: it cannot hold wrong types or lone surrogates.
TYPED_OK = ("none", "extra", "developer", "drop_shape", "unknown_role", "empty", "huge", "dup", "nan")
MUTATIONS = {
    "parquet": TYPED_OK,
    "json": (*TYPED_OK, "surrogate", "surrogate_id", "bad_id", "deep", "not_object", "retype", "drop_any"),
    "jsonl": (*TYPED_OK, "surrogate", "surrogate_id", "bad_id", "deep", "not_object", "retype", "drop_any",
              "malformed", "bad_bytes"),
}  # fmt: skip
UNREADABLE = {"deep", "not_object", "malformed", "bad_bytes"}


def shape_of(row: dict) -> str:
    return next(k for k in ("input_ids", "messages", "conversations", "text") if k in row)


def first_turn(row: dict) -> dict | None:
    """The row's first user turn (always a string), for conversations."""
    shape = shape_of(row)
    if shape not in ("messages", "conversations"):
        return None
    return next(m for m in row[shape] if m.get("role") == "user" or m.get("from") == "human")


def paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path below the row's root, ids excluded (their mutations are told apart)."""
    out = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if prefix or key not in ("id", "conversation_id"):
            out += [(*prefix, key), *paths(item, (*prefix, key))]
    return out


def at(row: dict, path: tuple) -> tuple[Any, Any]:
    """(container, key) of ``path`` in ``row``."""
    for key in path[:-1]:
        row = row[key]
    return row, path[-1]


@dataclass
class Case:
    """One dataset row as written to the file, and what the run must make of it."""

    raw: dict | bytes | Any  # a row, raw bytes (JSON formats), or a non-object JSON value
    mutation: str
    expect: str | None  # None: stored; else the error's kind, or UNKNOWN


@st.composite
def cases(draw: st.DrawFn, fmt: str, vocab: int) -> list[Case]:
    out: list[Case] = []
    for n in range(draw(st.integers(1, 10))):
        row = draw(any_row(vocab))
        id_kind = draw(st.sampled_from(["none", "str"] if fmt == "parquet" else ["none", "str", "int"]))
        if id_kind != "none":
            row["id"] = f"id-{n}" if id_kind == "str" else 10_000 + n
        mutation = draw(st.sampled_from(MUTATIONS[fmt]))
        out.append(mutate(draw, row, mutation, n, out, fmt))
    return out


def mutate(draw: st.DrawFn, row: dict, mutation: str, n: int, earlier: list[Case], fmt: str) -> Case:
    shape, turn = shape_of(row), first_turn(row)
    expect: str | None = None
    if mutation == "extra":
        row["extra_" + draw(NAME)] = draw(TEXT)
    elif mutation == "developer" and turn is not None:
        key = "role" if shape == "messages" else "from"
        row[shape].insert(0, {key: "developer", ("content" if key == "role" else "value"): draw(TEXT)})
    elif mutation == "unknown_role" and turn is not None:
        turn["role" if "role" in turn else "from"] = "wizard"
        expect = "row"
    elif mutation in ("drop_shape", "unknown_role"):
        row[shape] = None
        expect = "row"
    elif mutation == "empty":
        row[shape] = "" if shape == "text" else []
        expect = "row"
    elif mutation == "huge":
        if turn is not None:
            turn["content" if "content" in turn else "value"] = HUGE
        elif shape == "text":
            row["text"] = HUGE
        else:
            row["input_ids"] = row["input_ids"] * (MAX_LENGTH + 1)
            row.pop("loss_mask", None)
        expect = "overlong"
    elif mutation == "nan" and fmt == "parquet":
        row["extra_score"] = float("nan")  # a float column: harmless where nothing reads it
    elif mutation == "nan":
        if turn is not None:
            turn["content" if "content" in turn else "value"] = float("nan")
        else:
            row[shape] = float("nan") if shape == "text" else [float("nan")]
        expect = "row"
    elif mutation == "surrogate":
        lone = draw(st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff"]))
        if turn is not None:
            key = "content" if "content" in turn else "value"
            turn[key] = turn[key][:1] + lone + turn[key][1:]
        elif shape == "text":
            row["text"] += lone
        else:
            row["id"] = f"id-{n}{lone}"  # nothing in a token list can hold one: the id does
        expect = "encoding"
    elif mutation == "surrogate_id":
        row["id"] = f"id-\udfff{n}"
    elif mutation == "bad_id":
        row["id"] = draw(st.sampled_from([[n], {"n": n}, 1.5, True, float("nan")]))
    elif mutation == "dup":
        ids = [i for c in earlier if (i := usable_id(c)) is not None]
        if ids:
            row["id"] = draw(st.sampled_from(ids))
    elif mutation == "retype":
        container, key = at(row, draw(st.sampled_from(paths(row))))
        container[key] = draw(ANY_JSON)
        expect = UNKNOWN
    elif mutation == "drop_any":
        dicts = [p for p in paths(row) if isinstance(at(row, p)[0], dict)]
        container, key = at(row, draw(st.sampled_from(dicts)))
        del container[key]
        expect = UNKNOWN
    elif mutation == "deep":
        return Case(json.dumps({"id": f"deep-{n}"}).encode()[:-1] + b', "messages": ' + DEEP + b"}", mutation, "row")
    elif mutation == "not_object":
        return Case(draw(st.sampled_from([[1, 2], "a row", 7, None])), mutation, "row")
    elif mutation == "malformed":
        return Case(b'{"id": "broken", "messages": [', mutation, "row")
    elif mutation == "bad_bytes":
        return Case(b'{"text": "caf\xe9 au lait"}', mutation, "row")
    return Case(row, mutation, expect)


def usable_id(case: Case, n: int | None = None) -> str | None:
    """The id the row at ``n`` goes by, None when it cannot be read or its id cannot be used."""
    if not isinstance(case.raw, dict):
        return None
    value = case.raw.get("id")
    if value is None:
        return None if n is None else str(n)
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None
    text = str(value)
    return None if any(0xD800 <= ord(c) <= 0xDFFF for c in text) else text


def expected(rows: list[Case]) -> dict[int, str | None]:
    """Row -> None (stored), an error kind, or UNKNOWN; written from the mutations, not from the code."""
    seen: set[str] = set()
    out: dict[int, str | None] = {}
    for n, case in enumerate(rows):
        sid = usable_id(case, n)
        if not isinstance(case.raw, dict) or case.mutation in UNREADABLE:
            out[n] = "row"
        elif sid is None:
            out[n] = "encoding" if case.mutation in ("surrogate_id", "surrogate") else "row"
        elif sid in seen:
            out[n] = "duplicate_id"
        else:
            seen.add(sid)
            out[n] = case.expect
    return out


# --- files ---------------------------------------------------------------------------------------


def write(rows: list[Case], fmt: str, folder: Path) -> Path:
    if fmt == "parquet":
        path = folder / "rows.parquet"
        dicts = [c.raw for c in rows]
        keys = list(dict.fromkeys(k for r in dicts for k in r))
        pq.write_table(pa.table({k: [r.get(k) for r in dicts] for k in keys}), path, row_group_size=3)
        return path
    items = [c.raw if isinstance(c.raw, bytes) else json.dumps(c.raw).encode() for c in rows]
    path = folder / f"rows.{fmt}"
    path.write_bytes(b"\n".join(items) + b"\n" if fmt == "jsonl" else b"[\n" + b",\n".join(items) + b"\n]\n")
    return path


# --- the property --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_factory() -> Iterator[EngineFactory]:
    """One tiny-model engine for every example (loading it is most of a small run's time), on the session's one
    thread (tests/service_fixtures.py): a 64-wide model gains nothing from more, and on a busy 2-core box their spinning
    costs 10x."""
    engines: dict[tuple, Engine] = {}
    build = cpu_hf()

    def make(capture: CaptureSpec, folder: ModelFolder) -> Engine:
        key = (folder.path, capture.layers, capture.final_kind)
        if key not in engines:
            engines[key] = build(capture, folder)
        return engines[key]

    yield make


@pytest.mark.parametrize("fmt", ROW_FORMATS)
def test_no_row_stops_a_run_each_bad_row_is_reported_once_each_good_row_stored_once(
    fmt: str, tiny_llama: Path, engine_factory: Callable
) -> None:
    vocab = len(ModelFolder.read(tiny_llama).load_tokenizer())

    @settings(max_examples=25)
    @given(rows=cases(fmt, vocab))
    def check(rows: list[Case]) -> None:
        want = expected(rows)
        note(f"expected outcomes: {want}")
        with tempfile.TemporaryDirectory() as tmp:
            data = write(rows, fmt, Path(tmp))
            spec = ExtractionSpec(model=tiny_llama, data=data, layers=(1, 2, 3), max_length=MAX_LENGTH, overlong="skip")
            report = run_extraction(spec, Path(tmp) / "out", engine_factory)
            store = OutputStore.open_existing(Path(tmp) / "out")
            stored = {r.index: sid for sid, r in store.records().items()}
            errors = {e["row"]: e for e in store.errors()}
            error_lines = Counter(e["row"] for e in read_jsonl_dir(Path(tmp) / "out" / ERRORS_DIR))
            index_lines = Counter(d["index"] for d in read_jsonl_dir(Path(tmp) / "out" / INDEX_DIR))
        note(f"stored: {stored}; errors: {[(n, e['kind'], e['reason'][:80]) for n, e in errors.items()]}")

        assert sorted([*stored, *errors]) == list(range(len(rows)))  # every row once: stored or reported
        assert max([*error_lines.values(), *index_lines.values()], default=1) == 1
        for n, kind in want.items():
            if kind is None:
                assert n in stored and stored[n] == usable_id(rows[n], n), n
            elif kind != UNKNOWN:
                assert errors[n]["kind"] == kind, (n, errors.get(n))
        assert all(e["kind"] in ROW_KINDS and e["kind"] not in ("internal", "capture") for e in errors.values())
        assert report.row_errors + report.skipped_overlong == len(errors)

    check()
