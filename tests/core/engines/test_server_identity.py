"""A server's identity, checked before any sample (the folder it serves, real weights, what it captures), and
its input limit, which rows are kept within.

The refusals run against real CPU SGLang capture servers (attached by URL, as ``--server-url`` and a worker's
``LAYERTAP_SERVER_URL`` do); the comparison itself is also checked on ``/server_info`` replies taken apart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from layertap.engines.server_facts import ServerFacts, check_server, expectation_for, quantization_mismatch
from layertap.engines.sglang import SGLangEngine
from layertap.engines.sglang.process import SGLangServer
from layertap.errors import ServerError
from layertap.models.folder import ModelFolder
from layertap.spec import resolve_capture
from layertap.store.store import OutputStore
from layertap.tiny import build_tiny_model
from layertap.verify import verify_store
from sglang_patch.identity import model_identity
from tests.sglang_fixtures import DEFAULT_LAYERS, REPO_ROOT

LAYERS = DEFAULT_LAYERS["llama"]


def _extract(model: Path, server, data: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """``layertap extract`` attached to ``server`` by URL, as the README runs Kimi-K2.5 on a node."""
    cmd = [sys.executable, "-m", "layertap", "extract", "--engine", "sglang", "--server-url", server.url,
           "--dump-root", str(server.dump_root), "--model", str(model), "--data", str(data),
           "--layers", ",".join(map(str, LAYERS)), "--out", str(out), *extra]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT, env=os.environ.copy())


def test_attaching_to_a_server_of_another_folder_of_the_same_shape_is_refused_and_stores_nothing(
    sglang_llama, tiny_llama, tmp_path
) -> None:
    other = build_tiny_model("llama", tmp_path / "other-llama", seed=1)  # the same config, other weights
    assert (other / "config.json").read_bytes() == (tiny_llama / "config.json").read_bytes()
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i}", "input_ids": list(range(5, 40 + i))}) + "\n" for i in range(3)))

    refused = _extract(other, sglang_llama, data, tmp_path / "out")
    assert refused.returncode == 2, refused.stderr[-3000:]
    said = " ".join(refused.stderr.split())
    assert f"refusing the SGLang server at {sglang_llama.url}: it serves {tiny_llama} (weights " in said
    assert f"), --model is {other} (weights " in said
    assert not (tmp_path / "out").exists()  # refused before the store was made: nothing stored

    # The folder the server serves is accepted, and the manifest records the server's facts.
    done = _extract(tiny_llama, sglang_llama, data, tmp_path / "ok")
    assert done.returncode == 0, done.stderr[-3000:]
    server = json.loads((tmp_path / "ok" / "manifest.json").read_text())["engine"]["server"]
    assert server["model"] == model_identity(tiny_llama) and server["load_format"] == "auto"
    assert server["capture"]["layers"] == list(LAYERS) and server["tp_size"] == 1
    servers = json.loads((tmp_path / "ok" / "manifest.json").read_text())["servers"]
    assert [(s["rows"], s["engine"]["server"]["model"]) for s in servers] == [([0, 3], model_identity(tiny_llama))]


def test_a_dummy_weight_server_is_refused_unless_a_benchmark_allows_it(sglang_servers, tiny_llama) -> None:
    server = sglang_servers(tiny_llama, layers=LAYERS, extra_args=["--load-format", "dummy"])
    capture = resolve_capture(list(LAYERS), convention="capture", num_layers=6, final="both")
    attach, folder = SGLangServer(url=server.url), ModelFolder.read(tiny_llama)
    with pytest.raises(ServerError, match=r"it makes random weights \(--load-format dummy\); pass --allow-dummy-w"):
        SGLangEngine(attach, capture, folder=folder, dump_root=server.dump_root, job="t", in_flight=4)
    bench = SGLangEngine(attach, capture, folder=folder, dump_root=server.dump_root, job="t", in_flight=4,
                         allow_dummy_weights=True)  # fmt: skip
    assert bench.describe()["server"]["load_format"] == "dummy"  # recorded in the manifest's engine


def _info(tiny_llama: Path, dump_root: Path, **overrides) -> dict:
    """A ``/server_info`` reply of a capture server on ``tiny_llama`` (the fields layertap reads)."""
    capture = {"dump_root": str(dump_root), "layers": list(LAYERS), "finals": ["post", "pre"], "rid_prefix": "hscap"}
    hooks = [{"name": "layertap-aux:1", "config": {"role": "aux:1", "capture": capture,
                                                   "model": model_identity(tiny_llama)}}]  # fmt: skip
    info = {"version": "0.5.10.post1", "model_path": str(tiny_llama), "load_format": "auto", "dtype": "float32",
            "quantization": None, "tp_size": 1, "dp_size": 1, "enable_dp_attention": False,
            "attention_backend": "torch_native", "chunked_prefill_size": 64, "forward_hooks": hooks,
            "max_req_input_len": 4090}  # fmt: skip
    return {**info, **overrides}


def test_each_difference_is_named_with_both_sides(tiny_llama, tmp_path) -> None:
    capture = resolve_capture(list(LAYERS), convention="capture", num_layers=6, final="post")
    expected = expectation_for(ModelFolder.read(tiny_llama), capture, rid_prefix="hscap", dump_root=tmp_path)
    good = ServerFacts.from_info("http://s", _info(tiny_llama, tmp_path))
    assert expected.problems(good) == [] and good.input_limit == 4089  # SGLang refuses max_req_input_len
    elsewhere = {"dump_root": "/elsewhere", "layers": list(LAYERS), "finals": ["post"], "rid_prefix": "hscap"}
    unnamed = [{"config": {"capture": {**elsewhere, "dump_root": str(tmp_path)}}}]  # a launcher naming no weights
    cases = {
        "it has no layertap capture hooks": _info(tiny_llama, tmp_path, forward_hooks=None),
        "it runs DP attention": _info(tiny_llama, tmp_path, enable_dp_attention=True),
        "it dumps into /elsewhere, this run reads": _info(
            tiny_llama, tmp_path, forward_hooks=[{"config": {"capture": elsewhere}}]
        ),
        "it serves /other, --model is": _info(tiny_llama, tmp_path, model_path="/other", forward_hooks=unnamed),
    }
    for said, info in cases.items():
        problems = expected.problems(ServerFacts.from_info("http://s", info))
        assert len(problems) == 1 and problems[0].startswith(said), problems
    # After a restart, any setting that changed is named, before and after.
    restarted = ServerFacts.from_info("http://s2", _info(tiny_llama, tmp_path, chunked_prefill_size=128))
    with pytest.raises(ServerError, match="after its restart chunked_prefill_size is 128, before it was 64"):
        check_server(restarted, expected, pinned=good)
    check_server(ServerFacts.from_info("http://s2", _info(tiny_llama, tmp_path)), expected, pinned=good)


def test_quantization_is_compared_only_where_both_sides_state_it() -> None:
    assert quantization_mismatch(None, "compressed-tensors") is None
    assert quantization_mismatch("fp8", None) is None
    assert quantization_mismatch("compressed_tensors", "compressed-tensors") is None
    assert (
        quantization_mismatch("fp8", "compressed-tensors") == "quantization 'fp8', the folder's is 'compressed-tensors'"
    )


def test_rows_as_long_as_the_context_are_kept_within_the_servers_limit(sglang_llama, tiny_llama, tmp_path) -> None:
    """The tiny Llama's context is 4096 tokens; the CPU server accepts at most 4089 (its max_req_input_len 4090,
    refused from there on). Rows of 4096 and 4095 tokens are truncated to the server's limit, not refused by it."""
    context = json.loads((tiny_llama / "config.json").read_text())["max_position_embeddings"]
    rows = [{"id": f"r{n}", "input_ids": [5 + i % 900 for i in range(n)]} for n in (context, context - 1, 300)]
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    refused = _extract(tiny_llama, sglang_llama, data, tmp_path / "refused", "--max-length", str(context))
    said = " ".join(refused.stderr.split())
    assert refused.returncode == 2 and f"max_length {context} is above the longest prompt the SGLang server accepts" \
        " (4089 tokens" in said, refused.stderr[-3000:]  # fmt: skip
    assert not (tmp_path / "refused").exists()

    out = tmp_path / "out"
    done = _extract(tiny_llama, sglang_llama, data, out)
    assert done.returncode == 0, done.stderr[-3000:]
    records = OutputStore.open_existing(out).records()
    assert {sid: (r.num_tokens, r.truncated) for sid, r in records.items()} == {
        "r4096": (4089, True), "r4095": (4089, True), "r300": (300, False)
    }  # fmt: skip
    assert OutputStore.open_existing(out).errors() == [] and verify_store(out, data=data).ok


def test_a_second_server_that_computes_otherwise_is_refused_by_the_store_naming_both(tiny_llama, tmp_path) -> None:
    """Each writer records its server's typed facts (`OutputStore.note_server`); one computing in another dtype
    into the same store is refused, nothing recorded for it; one computing alike is recorded beside the first."""
    from tests.core.store.test_adopt import _store

    first = _store(tmp_path / "out", "specforge")
    facts = ServerFacts.from_info("http://a", _info(tiny_llama, tmp_path))
    assert first.note_server(facts, (0, 5)) == []
    other = OutputStore(first.root, first.manifest, writer_id="b")
    bf16 = ServerFacts.from_info("http://b", _info(tiny_llama, tmp_path, dtype="bfloat16"))
    assert other.note_server(bf16, (5, 10)) == [
        f"dtype is 'bfloat16' here, 'float32' on the server at http://a that made rows [0, 5] of this store "
        f"({first.writer_id})"
    ]
    assert other.note_server(ServerFacts.from_info("http://c", _info(tiny_llama, tmp_path)), (5, 10)) == []
    assert [(s["rows"], s["engine"]["url"]) for s in first.servers()] == [([0, 5], "http://a"), ([5, 10], "http://c")]
