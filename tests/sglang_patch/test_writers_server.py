"""The plugin's writer threads and host-memory cap on real CPU servers.

Several writer threads with many requests in flight (mixed lengths, chunked prefill): each dump is
complete, written once (the server logs one line per dump written), holds its own rid's tokens and
equals HF. A cap smaller than any request, under a load of many short requests sent at once (SGLang packs
dozens into one pass, and each dump costs its one writer a few fsyncs): the forward pass waits,
and the host memory held when each dump is queued stays within what one pass reserves, whatever
the backlog would have been.
"""

from __future__ import annotations

import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from sglang_patch.contract import TMP_DIR, dump_dir_name, iter_dump_rids, parse_rid
from tests.sglang_fixtures import CHUNKED_PREFILL_SIZE, DEFAULT_LAYERS, SGLangServer
from tests.sglang_patch.test_server import assert_matches_hf, generate, random_prompts, wait_for_dump

pytestmark = pytest.mark.sglang

WRITER_THREADS = 4


def _send_all(server: SGLangServer, prompts: dict[str, list[int]], in_flight: int) -> dict[str, dict]:
    with ThreadPoolExecutor(in_flight) as pool:
        futures = {rid: pool.submit(generate, server, rid, ids, extra_key=rid) for rid, ids in prompts.items()}
        return {rid: f.result() for rid, f in futures.items()}


def _written(server: SGLangServer, rid: str) -> int:
    """How many times the server logged writing the dump of `rid`."""
    return len(re.findall(rf"dump {re.escape(dump_dir_name(rid))}: ok", server.log_path.read_text(errors="replace")))


def test_several_writers_24_in_flight_each_dump_once_its_own_and_equal_hf(
    sglang_servers: Any, tiny_llama: Path, hf_reference: Any
) -> None:
    server = sglang_servers(
        tiny_llama, layers=DEFAULT_LAYERS["llama"], extra_args=["--writer-threads", str(WRITER_THREADS)]
    )
    job = f"writers-{uuid.uuid4().hex[:8]}"
    lengths = {f"s{i}": n for i, n in enumerate([1, 5, 40, 64, 65, 129, 300, 700] * 3)}
    prompts = random_prompts(server.model_dir, job, lengths, seed=11)
    replies = _send_all(server, prompts, in_flight=len(prompts))
    for rid, ids in prompts.items():
        assert replies[rid]["meta_info"]["prompt_tokens"] == len(ids)
        dump = wait_for_dump(server, rid)
        assert dump.meta.rid == rid
        assert dump.meta.writer is not None and dump.meta.writer["threads"] == WRITER_THREADS
        assert dump.meta.writer["write_s"] > 0
        assert_matches_hf(dump, ids, server, hf_reference)  # its own rid's tokens, and HF's states
    assert all(_written(server, rid) == 1 for rid in prompts)
    assert sorted(r for r in iter_dump_rids(server.dump_root) if parse_rid(r).job == job) == sorted(prompts)
    assert list((server.dump_root / TMP_DIR).iterdir()) == []


def test_host_memory_cap_makes_the_forward_pass_wait_instead_of_growing(
    sglang_servers: Any, tiny_llama: Path, hf_reference: Any
) -> None:
    # 1 byte: every new request waits until the writers hold no dump; one writer thread.
    server = sglang_servers(
        tiny_llama, layers=DEFAULT_LAYERS["llama"], extra_args=["--writer-threads", "1", "--pinned-cap", "1"]
    )
    job = f"cap-{uuid.uuid4().hex[:8]}"
    lengths = {f"s{i}": 1 + i % 2 for i in range(256)}
    prompts = random_prompts(server.model_dir, job, lengths, seed=12)
    # All at once: SGLang queues them and runs passes back to back, each completing dozens of
    # requests whose dumps one writer thread needs far longer to write than the next pass takes.
    _send_all(server, prompts, in_flight=len(prompts))
    dumps = {rid: wait_for_dump(server, rid) for rid in prompts}
    for rid in list(prompts)[::40]:
        assert_matches_hf(dumps[rid], prompts[rid], server, hf_reference)
    stats = [d.meta.writer for d in dumps.values()]
    waited = sum(s["wait_s"] for s in stats)
    assert waited > 0, "the forward pass never waited for the writers"
    # Host bytes per prompt token: input_ids int64 + 3 aux states + 2 finals, float32, hidden 64.
    per_token = 8 + (len(server.layers) + len(server.finals)) * 64 * 4
    # What one pass can reserve (its new requests' whole prompts, plus one chunked request of 2
    # tokens at most) bounds what is held; without the cap the writers' backlog would be held too.
    bound = (CHUNKED_PREFILL_SIZE + 2) * per_token
    held = max(s["pinned_bytes"] for s in stats)
    print(f"forward pass waited {waited:.2f} s; most held {held} bytes (bound {bound})")
    assert held <= bound
