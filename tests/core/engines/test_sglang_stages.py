"""The SGLang engine's stage timings reach the worker's histograms: send, prefill, dump_wait, validate and handover
once per captured sample, refill once per slot a finished request left to a next one, on a real CPU capture server;
and the writer stats its dumps carry reach the writer series."""

from __future__ import annotations

import json
import time

import pytest
import torch
from prometheus_client import REGISTRY

from layertap.engines.sglang import SGLangEngine
from layertap.engines.sglang.process import SGLangServer
from layertap.models.folder import ModelFolder, model_dims
from layertap.sample import CapturedSample, TokenizedSample
from layertap.spec import resolve_capture
from worker.metrics import WorkerMetrics

pytestmark = pytest.mark.sglang
STAGES = ("send", "prefill", "dump_wait", "validate", "handover", "refill")
IN_FLIGHT = 4


def test_each_sample_reports_its_stage_times_and_each_freed_slot_its_refill(sglang_llama, tiny_llama) -> None:
    vocab = json.loads((tiny_llama / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(7)
    samples = [
        TokenizedSample(f"t{i}", i, torch.randint(4, vocab, (n,), generator=g), torch.ones(n, dtype=torch.uint8))
        for i, n in enumerate([5, 40, 300, 17, 120, 64, 9, 250])
    ]
    metrics = WorkerMetrics("stage-test")
    seen: list[tuple[str, float]] = []

    def observe(stage: str, seconds: float) -> None:
        seen.append((stage, seconds))
        metrics.observe_stage(stage, seconds)

    spec = resolve_capture(list(sglang_llama.layers), convention="capture", num_layers=model_dims(tiny_llama)[0],
                           final="both")  # fmt: skip
    engine = SGLangEngine(SGLangServer(url=sglang_llama.url), spec, folder=ModelFolder.read(tiny_llama), dump_root=sglang_llama.dump_root,
                          job="stages", in_flight=IN_FLIGHT, observe=observe, on_writer=metrics.observe_writer)  # fmt: skip
    t0 = time.perf_counter()
    results = list(engine.capture(samples))
    wall = time.perf_counter() - t0
    engine.close()  # attached, so the session's server keeps running

    assert all(isinstance(r, CapturedSample) for r in results) and len(results) == len(samples)
    for stage in STAGES:
        times = [t for s, t in seen if s == stage]
        assert len(times) == len(samples) - (IN_FLIGHT if stage == "refill" else 0), (stage, seen)
        assert all(0 <= t <= wall for t in times)
        count = REGISTRY.get_sample_value(
            "layertap_stage_duration_seconds_count", {"worker": "stage-test", "stage": stage}
        )
        total = REGISTRY.get_sample_value(
            "layertap_stage_duration_seconds_sum", {"worker": "stage-test", "stage": stage}
        )
        assert count == len(times) and total == pytest.approx(sum(times))
    # A prefill is an HTTP round trip through the model: it takes longer than nothing at all.
    assert min(t for s, t in seen if s == "prefill") > 1e-4
    writer = {"worker": "stage-test"}
    assert REGISTRY.get_sample_value("layertap_writer_threads", writer) >= 1
    assert REGISTRY.get_sample_value("layertap_writer_busy_seconds_total", {**writer, "phase": "write"}) > 0
    assert REGISTRY.get_sample_value("layertap_writer_busy_seconds_total", {**writer, "phase": "copy_wait"}) >= 0
