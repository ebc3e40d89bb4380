"""Property-based: ``POST /jobs`` on a real uvicorn coordinator and Redis, with generated JSON bodies.

Whatever the body (any JSON value; a valid job with any field replaced by a wrong type, an absurd
number, a path that is empty, relative, outside the root, too long, holds NUL or a lone surrogate, or
names a file that is no dataset; NaN; unknown fields), the answer is a refusal with a readable
message (4xx; 507 when the job would not fit on disk), never a 500, and a refused job leaves nothing
in Redis and nothing under the output root. A body that happens to be a valid job gets 201.

Derandomized with a fixed budget (the "layertap" profile in tests/conftest.py), so CI failures reproduce.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from hypothesis import example, given, note, settings
from hypothesis import strategies as st
from redis import Redis

from layertap.state.keys import SHARD_QUEUE
from tests.core.datasets import conversation_rows, write_jsonl

ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
ODD_PATHS = ["", "/", ".", "..", "../../escape", "/dev/null", "/proc/self/status", "a\x00b", "/tmp/\x00",
             "/\ud800", "\udcff/x", "/" + "n" * 300, "a/" * 2100, "~/data.jsonl", "C:\\data.jsonl"]  # fmt: skip
ABSURD_INTS = [0, -1, 2**31, 2**63, 10**30, -(10**30), 10**400]


def field_values(good: dict[str, str], files: dict[str, str]) -> dict[str, st.SearchStrategy]:
    """What each field of a job body may be replaced with: its own kind of wrong, or anything."""
    odd = st.sampled_from(ODD_PATHS)
    paths = odd | odd | st.text(max_size=12) | st.text(max_size=12).map(lambda s: "/" + s)
    ints = st.integers(-5, 200) | st.sampled_from(ABSURD_INTS) | st.floats()
    return {
        "model": st.sampled_from([good["model"], files["data"], files["dir"]]) | paths,
        "data": st.sampled_from(list(files.values())) | paths,
        "layers": st.lists(st.integers(-2, 8) | st.sampled_from(ABSURD_INTS), max_size=4) | ANY_JSON,
        "layer_convention": st.sampled_from(["capture", "sglang-eagle3", "vllm", "CAPTURE", ""]) | ANY_JSON,
        "final": st.sampled_from(["post", "pre", "both", None, "none"]) | ANY_JSON,
        "format": st.sampled_from(["specforge", "speculators", "parquet"]) | ANY_JSON,
        "store_dtype": st.sampled_from(["bfloat16", "float16", "float32", "int8"]) | ANY_JSON,
        "max_length": ints | ANY_JSON,
        "max_bad_rows": st.sampled_from(["1%", "0", "100%", "5 %", "-1", "101%", "nan%", "1e3"]) | ints | ANY_JSON,
        "overlong": st.sampled_from(["truncate", "skip", "drop"]) | ANY_JSON,
        "out": paths | st.none() | ANY_JSON,
        "shard_size": ints | ANY_JSON,
        "engine": st.dictionaries(st.sampled_from(["in_flight", "batch_size", "batch_tokens", "nope"]), ints)
        | ANY_JSON,
        "sample_attempts": ints | ANY_JSON,
        "expected_tokens": ints | ANY_JSON,
        "audit_samples": ints | ANY_JSON,
    }


@st.composite
def job_bodies(draw: st.DrawFn, good: dict[str, str], files: dict[str, str]) -> object:
    """Any JSON value; or the good body with one field replaced (most often: each refusal has one cause);
    or with a few fields replaced, removed or added."""
    shape = draw(st.integers(0, 9))
    if shape == 0:
        return draw(ANY_JSON)
    body: dict[str, object] = dict(good)
    values = field_values(good, files)
    if shape <= 6:
        name = draw(st.sampled_from(sorted(values)))
        body[name] = draw(values[name])
        return body
    for name in draw(st.lists(st.sampled_from(sorted(values)), min_size=1, max_size=3, unique=True)):
        action = draw(st.sampled_from(["replace", "remove", "add-unknown"]))
        if action == "replace":
            body[name] = draw(values[name])
        elif action == "remove":
            body.pop(name, None)
        else:
            body[draw(st.text(min_size=1, max_size=8))] = draw(ANY_JSON)
    return body


@pytest.fixture
def coordinator(services, redis_server, redis_client: Redis, tmp_path: Path):
    """A coordinator started after ``redis_client`` flushed the session Redis, whose watchdog passes once, at its start:
    started first, its passes read what an earlier test left (a shard queued, its message gone) and one requeued it
    after an example's FLUSHALL (a loaded box, 2026-12-07)."""
    output_root = tmp_path / "outputs"
    output_root.mkdir()
    return services.coordinator(redis_server.url, output_root, LAYERTAP_REAPER_INTERVAL_S="3600"), output_root


def test_any_job_body_gets_a_readable_refusal_never_a_500_and_a_refused_job_leaves_nothing(
    coordinator, redis_client: Redis, tiny_llama: Path, tmp_path: Path
) -> None:
    server, output_root = coordinator
    files = {"data": str(write_jsonl(tmp_path / "data.jsonl", conversation_rows(12, seed=3)))}
    for name, content in [("rows.csv", b"a,b\n1,2\n"), ("empty.jsonl", b"\n"), ("bad.parquet", b"PAR1 no"),
                          ("broken.json", b'[{"text": "a"'), ("notes.txt", b"hello")]:  # fmt: skip
        (tmp_path / name).write_bytes(content)
        files[name] = str(tmp_path / name)
    (tmp_path / "folder").mkdir()
    files["dir"] = str(tmp_path / "folder")
    good = {"model": str(tiny_llama), "data": files["data"], "layers": [1, 3, 5], "shard_size": 5}
    seen: dict[int, int] = {}

    @settings(max_examples=80)
    @given(body=job_bodies(good, files))
    # Found by this property once (each was a 500): kept as fixed examples.
    @example(body={**good, "expected_tokens": math.inf})  # the 422 echoed NaN/inf, which JSON cannot hold
    @example(body={**good, "layers": ["\ud800"]})  # ... or a lone surrogate
    @example(body={**good, "expected_tokens": 10**400})  # too large to estimate in floats
    @example(body={**good, "out": "a/" * 2100})  # ENAMETOOLONG from the filesystem
    @example(body={**good, "out": "n" * 300})
    @example(body={**good, "out": "a\x00b"})  # ValueError from os.stat
    @example(body={**good, "out": "x\ud800"})  # UnicodeEncodeError from os.stat
    @example(body={**good, "data": "/" + "n" * 300})  # ENAMETOOLONG from Path.exists()
    @example(body={**good, "model": "/" + "n" * 300})
    def check(body: object) -> None:
        redis_client.flushall()
        for child in output_root.iterdir():
            shutil.rmtree(child)
        content = json.dumps(body)  # NaN and lone surrogates as Python's json writes them
        with server.client() as api:
            reply = api.post("/jobs", content=content, headers={"content-type": "application/json"})
        note(f"{reply.status_code}: {reply.text[:500]}")
        seen[reply.status_code] = seen.get(reply.status_code, 0) + 1
        if reply.status_code == 201:
            return
        assert 400 <= reply.status_code < 500 or reply.status_code == 507
        detail = reply.json()["detail"]  # JSON, whatever the body held
        assert detail and (isinstance(detail, str) or all(e.get("msg") for e in detail))
        assert redis_client.llen(SHARD_QUEUE) == 0 and not redis_client.keys("layertap:*")
        assert not any(output_root.iterdir())

    check()
    print(f"status codes seen: {seen}")
    assert seen.get(201) and seen.get(422), seen  # the generator reaches both sides
