"""Tensor-parallel capture on real CPU servers (sglang 0.5.10 at ``--tp-size 2``, ranks over gloo):
only TP rank 0 registers hooks and writes, each dump is written once, and every state equals HF's
on the same weights, for the Llama-like and the Kimi-K2-like (MLA + MoE, experts split over ranks)
tiny models. What needs two GPUs (FlashInfer all-reduce fusion, H200 throughput) is not here.
"""

from __future__ import annotations

import re

import pytest

from layertap.sample import CapturedSample
from tests.core.engines.test_sglang_engine import REL_TOL, _engine, _samples
from tests.sglang_fixtures import DEFAULT_LAYERS
from tests.sglang_patch.test_server import rel

pytestmark = pytest.mark.sglang
LOG_RANK = re.compile(r"^\[[^\]]* (TP\d+)\] (.*)$")


@pytest.mark.parametrize(("arch", "model_fixture", "n"), [("llama", "tiny_llama", 40), ("kimi-k2", "tiny_kimi", 24)])
def test_tp2_writes_once_from_rank_0_and_equals_hf(arch, model_fixture, n, request, sglang_servers, hf_reference):
    model_dir = request.getfixturevalue(model_fixture)
    server = sglang_servers(model_dir, layers=DEFAULT_LAYERS[arch], tp_size=2)
    engine = _engine(server.url, server.dump_root, model_dir, server.layers, in_flight=8)
    samples = [s for s in _samples(model_dir, n, seed=11) if s.num_tokens <= 1000]
    results = list(engine.capture(samples))
    assert all(isinstance(r, CapturedSample) for r in results) and len(results) == len(samples)
    ref = hf_reference(model_dir)
    for r in results:
        hidden, pre = ref.states(r.sample.input_ids)
        errs = [rel(r.aux[:, j], hidden[i]) for j, i in enumerate(server.layers)]
        errs += [rel(r.final_post, hidden[-1]), rel(r.final_pre, pre)]
        assert max(errs) < REL_TOL, (r.sample.sample_id, r.sample.num_tokens, errs)
        engine.release(r)

    by_rank: dict[str, list[str]] = {}
    for line in server.log_path.read_text(errors="replace").splitlines():
        if m := LOG_RANK.match(line):
            by_rank.setdefault(m.group(1), []).append(m.group(2))
    assert set(by_rank) == {"TP0", "TP1"}, "the server did not run two TP ranks"
    roles = [f"aux:{i}" for i in server.layers] + ["final_post", "final_pre"]
    assert {f"layertap: not the writer rank, no {role} hook here" for role in roles} <= set(by_rank["TP1"])
    assert not [m for m in by_rank["TP0"] if "not the writer rank" in m]
    dumps = {rank: [m.split(":")[0] for m in msgs if m.startswith("dump hscap")] for rank, msgs in by_rank.items()}
    assert dumps["TP1"] == [] and len(dumps["TP0"]) == len(set(dumps["TP0"])) == len(samples)
    assert not [m for msgs in by_rank.values() for m in msgs if "failed to write the dump" in m]
