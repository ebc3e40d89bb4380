"""The SGLang engine against real CPU servers: many requests in flight, chunked prefill, warmup on,
/health probed throughout; every sample equal to the HF reference; cache hits and dead servers handled.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import threading
import weakref
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.sglang import CPU_SERVER_ARGS, cpu_server_env
from layertap.engines.sglang import SGLangEngine
from layertap.engines.sglang.launch import ServerConfig
from layertap.engines.sglang.process import SGLangServer
from layertap.models.folder import ModelFolder, model_dims
from layertap.pipeline import run_extraction
from layertap.sample import CapturedSample, TokenizedSample
from layertap.spec import ExtractionSpec, resolve_capture
from layertap.store.store import OutputStore
from layertap.verify import verify_store
from sglang_patch.contract import dump_dir, iter_dump_rids, parse_rid
from tests.sglang_fixtures import DEFAULT_LAYERS
from tests.sglang_patch.test_server import HealthProber, rel

pytestmark = pytest.mark.sglang
REL_TOL = 1e-4


def _lengths(n: int, seed: int) -> list[int]:
    """Log-uniform lengths in [1, 2000], both ends included."""
    rng = random.Random(seed)
    return [1, 2000] + [int(math.exp(rng.uniform(0, math.log(2000)))) for _ in range(n - 2)]


def _samples(model_dir: Path, n: int, seed: int) -> list[TokenizedSample]:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    return [
        TokenizedSample(f"s{i}", i, torch.randint(4, vocab, (t,), generator=g), torch.ones(t, dtype=torch.uint8))
        for i, t in enumerate(_lengths(n, seed))
    ]


def _engine(server_url: str, dump_root: Path, model_dir: Path, layers, **kw: Any) -> SGLangEngine:
    num_layers, _ = model_dims(model_dir)
    spec = resolve_capture(list(layers), convention="capture", num_layers=num_layers, final="both")
    return SGLangEngine(
        SGLangServer(url=server_url), spec, folder=ModelFolder.read(model_dir), dump_root=dump_root, job="test", **kw
    )


# 5 rounds and 1+ of 16 in flight, every length from 1 to 2,000 tokens interleaved; the suite's 30 minutes do not pay
# for more (200 and 40 samples took 231 s of it).
@pytest.mark.parametrize(("arch", "model_fixture", "n"), [("llama", "tiny_llama", 80), ("kimi-k2", "tiny_kimi", 20)])
def test_mixed_samples_16_in_flight_all_equal_hf(arch, model_fixture, n, request, sglang_servers, hf_reference):
    model_dir = request.getfixturevalue(model_fixture)
    server = sglang_servers(model_dir, layers=DEFAULT_LAYERS[arch])
    engine = _engine(server.url, server.dump_root, model_dir, server.layers, in_flight=16)
    samples = _samples(model_dir, n, seed=4)
    with HealthProber(server.url) as prober:
        results = list(engine.capture(samples))
    assert prober.codes and set(prober.codes) == {200}
    assert all(isinstance(r, CapturedSample) for r in results), [
        r for r in results if not isinstance(r, CapturedSample)
    ][:3]
    assert sorted(r.sample.sample_id for r in results) == sorted(
        s.sample_id for s in samples
    )  # none missing or doubled
    ref = hf_reference(model_dir)
    worst = 0.0
    for r in results:
        hidden, pre = ref.states(r.sample.input_ids)
        errs = [rel(r.aux[:, j], hidden[i]) for j, i in enumerate(server.layers)]
        errs += [rel(r.final_post, hidden[-1]), rel(r.final_pre, pre)]
        assert max(errs) < REL_TOL, (r.sample.sample_id, r.sample.num_tokens, errs)
        worst = max(worst, *errs)
    print(f"{arch}: {len(results)} samples, worst relative error {worst:.2e}")
    for r in results:  # as the pipeline does once a sample is committed
        engine.release(r)
    # The server is shared with other tests: only this engine's job must leave no dump behind.
    leftovers = [r for r in iter_dump_rids(server.dump_root) if parse_rid(r).job == engine.job]
    assert leftovers == [], f"dumps left behind: {leftovers[:3]}"


def _dataset(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prefix_cache_hit_is_caught_and_never_stored(sglang_servers, tiny_llama, tmp_path):
    server = sglang_servers(tiny_llama, layers=DEFAULT_LAYERS["llama"], extra_args=["--keep-radix-cache"])
    ids = torch.randint(4, 1000, (150,), generator=torch.Generator().manual_seed(9)).tolist()
    # Two rows with the same tokens: on sglang 0.5.10 (which ignores extra_key) the second is served
    # from the radix cache, so its first rows never pass the hooks. It must fail, not be stored.
    data = _dataset(tmp_path / "d.jsonl", [{"id": "first", "input_ids": ids}, {"id": "again", "input_ids": ids}])
    spec = ExtractionSpec(model=tiny_llama, data=data, layers=DEFAULT_LAYERS["llama"], store_dtype="float32")
    report = run_extraction(
        spec,
        tmp_path / "out",
        lambda cap, _folder: _engine(server.url, server.dump_root, tiny_llama, cap.layers, in_flight=1),
    )
    assert report.computed == ["first"] and report.failed == 1
    errors = OutputStore.open_existing(tmp_path / "out").errors()
    assert [e["sample_id"] for e in errors] == ["again"] and "prefix-cache hit" in errors[0]["reason"]
    assert set(OutputStore.open_existing(tmp_path / "out").records()) == {"first"}
    assert verify_store(tmp_path / "out").ok


class _NotesWhereCapturesDie(SGLangEngine):
    """The SGLang engine, noting the thread in which each capture's states die (its dump's mapping with them)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.died_in: list[str] = []

    def _read_dump(self, rid: str, path: Path, sample: TokenizedSample, t1: float) -> tuple[CapturedSample, str]:
        captured, rid = super()._read_dump(rid, path, sample, t1)
        weakref.finalize(captured.aux, lambda: self.died_in.append(threading.current_thread().name))
        return captured, rid


def test_each_capture_dies_in_the_thread_that_committed_it(sglang_servers, tiny_llama, tmp_path):
    """Neither the capture generator nor the thread driving it keeps a capture once it is handed to its commit: the
    dump is unmapped (and, stream-only, its pages freed) by the commit thread, not by the thread that sends the next
    requests."""
    server = sglang_servers(tiny_llama, layers=DEFAULT_LAYERS["llama"])
    rows = [{"id": s.sample_id, "input_ids": s.input_ids.tolist()} for s in _samples(tiny_llama, 40, seed=6)]
    spec = ExtractionSpec(model=tiny_llama, data=_dataset(tmp_path / "d.jsonl", rows), layers=DEFAULT_LAYERS["llama"])
    engines: list[_NotesWhereCapturesDie] = []

    def engine(cap, folder):
        engines.append(_NotesWhereCapturesDie(SGLangServer(url=server.url), cap, folder=folder,
                                              dump_root=server.dump_root, job="where", in_flight=16))  # fmt: skip
        return engines[0]

    report = run_extraction(spec, tmp_path / "out", engine)
    assert len(report.computed) == len(rows)
    died_in = engines[0].died_in
    assert len(died_in) == len(rows) and all(name.startswith("commit") for name in died_in), Counter(died_in)


class _KillWhileWritersHoldDumps(SGLangEngine):
    """The SGLang engine, killing its server (once, after `after` replies) at a reply whose dump the
    server's writers have not written yet: the moment a crash could lose an answered request. A loaded
    machine may write every dump before its reply arrives; then the kill comes at reply `2 * after`
    anyway, while requests remain to be resent. What the store held then is kept in `committed_at_kill`
    (sample id -> sha256)."""

    def __init__(self, *args: Any, out: Path, after: int, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.out, self.after, self.replies = out, after, itertools.count(1)
        self.committed_at_kill: dict[str, str] | None = None

    def _wait_for_dump(self, rid: str, restarts: int) -> Path:
        n = next(self.replies)
        late = n >= 2 * self.after
        if self.committed_at_kill is None and n >= self.after and (late or not dump_dir(self.dump_root, rid).exists()):
            records = OutputStore.open_existing(self.out).records().values()
            self.committed_at_kill = {r.sample_id: r.sha256 for r in records}
            self.server.kill()
        return super()._wait_for_dump(rid, restarts)


def test_server_killed_while_writers_hold_dumps_loses_nothing_committed(
    tiny_llama, cuda_stub_dir, tmp_path, hf_reference, sglang_python
):
    layers = DEFAULT_LAYERS["llama"]
    # The server writes specforge files itself (loss masks sent with the requests): commits are
    # renames. Several writer threads under a small host-memory cap, so dumps queue up in the server.
    config = ServerConfig(
        python=sglang_python, model=tiny_llama, dump_root=tmp_path / "dumps", layers=layers, final="post",
        log_path=tmp_path / "server.log", env=cpu_server_env(cuda_stub_dir), layout="specforge",
        writer_threads=3, pinned_cap="256K",
        sglang_args=(*CPU_SERVER_ARGS, "--dtype", "float32", "--chunked-prefill-size", "64"),
    )  # fmt: skip
    server = SGLangServer(config)
    server.start()
    num_layers, _ = model_dims(tiny_llama)
    rng = random.Random(5)
    rows = [
        {"id": s.sample_id, "input_ids": s.input_ids.tolist(), "loss_mask": [rng.randint(0, 1) for _ in s.input_ids]}
        for s in _samples(tiny_llama, 40, seed=5)
    ]
    data = _dataset(tmp_path / "d.jsonl", rows)
    out = tmp_path / "out"
    spec = ExtractionSpec(model=tiny_llama, data=data, layers=layers, store_dtype="float32")
    engines: list[_KillWhileWritersHoldDumps] = []

    def engine(cap, folder):
        engines.append(_KillWhileWritersHoldDumps(server, cap, folder=folder, dump_root=config.dump_root, job="kill",
                                                  in_flight=16, out=out, after=16))  # fmt: skip
        return engines[0]

    try:
        report = run_extraction(spec, out, engine)
    finally:
        server.stop()
    committed = engines[0].committed_at_kill
    assert committed is not None, "no reply ever came before its dump: the server was never killed"
    assert server.restarts == 1 and len(committed) >= 1
    assert report.failed == 0 and len(report.computed) == len(rows)
    check = verify_store(out)
    assert check.ok and check.samples == len(rows), check.problems
    store = OutputStore.open_existing(out)
    records = store.records()
    # Everything the store had committed when the server died is still there, byte for byte.
    assert {sid: records[sid].sha256 for sid in committed} == committed
    ref = hf_reference(tiny_llama)
    masks = {r["id"]: r["loss_mask"] for r in rows}
    for rec in records.values():
        obj = store.format.load(out / rec.file)
        assert obj["loss_mask"].tolist() == masks[rec.sample_id]
        hidden, _ = ref.states(obj["input_ids"])
        assert rel(obj["hidden_state"][0], hidden[num_layers]) < REL_TOL
        assert rel(obj["aux_hidden_state"][0, :, :64], hidden[layers[0]]) < REL_TOL


def test_cli_extract_engine_sglang_launches_its_server(
    tiny_llama, cuda_stub_dir, tmp_path, hf_reference, sglang_python
):
    import os
    import subprocess
    import sys

    from tests.core.datasets import conversation_rows, write_jsonl

    data = write_jsonl(tmp_path / "chats.jsonl", conversation_rows(20, seed=8))
    out = tmp_path / "states"
    sglang_args = " ".join((*CPU_SERVER_ARGS, "--dtype", "float32", "--chunked-prefill-size", "64"))
    cli = subprocess.run(
        [sys.executable, "-m", "layertap", "extract", "--model", str(tiny_llama), "--data", str(data),
         "--layers", "1,3,5", "--out", str(out), "--format", "speculators", "--store-dtype", "float32",
         "--engine", "sglang", "--sglang-python", str(sglang_python), "--sglang-args", sglang_args,
         "--dump-root", str(tmp_path / "dumps"), "--in-flight", "8"],
        env={**os.environ, **cpu_server_env(cuda_stub_dir)}, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-4000:]
    check = verify_store(out)
    assert check.ok and check.samples == 20, check.problems
    store = OutputStore.open_existing(out)
    assert store.manifest.engine["name"] == "sglang"
    ref = hf_reference(tiny_llama)
    for rec in store.records().values():
        states = store.format.load(out / rec.file)["hidden_states"]
        hidden, pre = ref.states(store.format.load(out / rec.file)["token_ids"])
        assert rel(states[:, 1], hidden[3]) < REL_TOL and rel(states[:, 3], pre) < REL_TOL
    # Where the run's time went, in its report: every stage timed for every sample, and no stage's sum above what
    # its overlapping workers (8 requests in flight, the commit threads) could spend within the rows' seconds.
    [report] = [json.loads(p.read_text()) for p in (out / "reports").glob("run-*.json")]
    stages, rows_s = report["stage_seconds"], report["rows_seconds"]
    assert set(stages) == {"send", "prefill", "dump_wait", "validate", "handover", "refill", "plan", "commit", "settle",
                           "server_ready", "server_write"}, stages  # fmt: skip
    assert max(stages["prefill"], stages["dump_wait"], stages["validate"]) < 8 * rows_s, (stages, rows_s)
    assert 0 < stages["server_write"] < 4 * rows_s, (stages, rows_s)  # the server's 4 writers, from its meta.json
    # A CPU server's forward pass takes longer than reading a small dump, which takes some time.
    assert stages["prefill"] > stages["validate"] > 0, stages
