"""``token_freq.pt`` is counted as samples are committed, and equals a recount from the stored samples after a
fresh run, a resumed run (SIGKILL mid-run, a corrupted file redone) and a rewrite by ``layertap verify``.

The 2-worker distributed run is checked by every distributed test (`tests/worker/conftest.py::check_output`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from layertap.store.index import read_jsonl_dir
from layertap.store.store import OutputStore
from layertap.store.token_freq import TOKEN_FREQ_DIR
from layertap.verify import verify_store
from tests.core.datasets import conversation_rows, write_jsonl
from tests.core.trainer_reads import masked_token_counts, token_freq_file


def _cmd(cli, model: Path, data: Path, out: Path, fmt: str) -> list[str]:
    return [*cli.argv, "extract", "--model", str(model), "--data", str(data), "--layers",
            "1,3,5", "--out", str(out), "--format", fmt, "--batch-tokens", "1"]  # fmt: skip


def _run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


def _log_lines(out: Path, folder: str) -> int:
    return sum(f.read_bytes().count(b"\n") for f in (out / folder).glob("*.jsonl")) if (out / folder).is_dir() else 0


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_a_fresh_run_writes_the_counts_of_its_loss_masked_tokens(layertap_cli, tiny_llama, tmp_path, fmt) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(20, seed=12))
    out = tmp_path / "out"
    _run(_cmd(layertap_cli, tiny_llama, data, out, fmt))
    counts = masked_token_counts(out)
    assert sum(counts.values()) > 100 and token_freq_file(out) == dict(counts)
    assert _log_lines(out, TOKEN_FREQ_DIR) == 20  # one line per committed sample, written as it was committed


def test_a_resumed_run_counts_each_sample_once(layertap_cli, tiny_llama, tmp_path) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(60, seed=13))
    out = tmp_path / "out"
    cmd = _cmd(layertap_cli, tiny_llama, data, out, "speculators")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while _log_lines(out, "index") < 20:
        assert proc.poll() is None and time.monotonic() < deadline, "extract ended or stalled before the kill"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "token_freq.pt").exists()  # killed before finalize

    _run(cmd)  # resume
    assert token_freq_file(out) == dict(masked_token_counts(out))

    # A corrupted file is redone on the next run: its sample now has two count lines, and still counts once.
    store = OutputStore.open_existing(out)
    victim = store.records()["conv-7"]
    (out / victim.file).write_bytes(b"garbage")
    _run(cmd)
    assert [d["sample_id"] for d in read_jsonl_dir(out / TOKEN_FREQ_DIR)].count("conv-7") == 2
    assert token_freq_file(out) == dict(masked_token_counts(out))
    assert verify_store(out).ok


def test_verify_recounts_and_can_rewrite_the_file(layertap_cli, tiny_llama, tmp_path) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(10, seed=14))
    out = tmp_path / "out"
    _run(_cmd(layertap_cli, tiny_llama, data, out, "specforge"))
    right = token_freq_file(out)
    (out / "token_freq.pt").unlink()
    assert any("token_freq.pt is missing" in p for p in verify_store(out).problems)

    import torch

    wrong = dict(right)
    token = next(iter(wrong))
    wrong[token] += 1
    torch.save(wrong, out / "token_freq.pt")
    [problem] = verify_store(out).problems
    assert f"differs from the stored samples' loss-masked tokens at 1 token ids (first: [{token}])" in problem

    cli = layertap_cli("verify", "--rewrite-token-freq", out)
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert token_freq_file(out) == right == dict(masked_token_counts(out))
