"""`layertap audit` PASSES on what real CPU SGLang servers captured (float32 compute, bf16 on disk): the tiny
Llama, the tiny Kimi-K2 and the Kimi-K2.5 wrapper (SGLang's own `kimi_k25` class). The servers are the session's
(the same arguments as the other SGLang tests, so a full run starts each once)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.core.audit.test_run import KIMI_LAYERS, assert_passes, extract
from tests.sglang_fixtures import DEFAULT_LAYERS, SGLangServer

pytestmark = pytest.mark.sglang


def attached(cli, model: Path, out: Path, server: SGLangServer, layers: tuple[int, ...], *args: str) -> Path:
    return extract(cli, model, out, layers, "--engine", "sglang", "--server-url", server.url,
                   "--dump-root", str(server.dump_root), "--in-flight", "4", *args)  # fmt: skip


def test_sglang_llama_and_kimi_stores_pass(
    layertap_cli, sglang_llama, sglang_kimi, tiny_llama, tiny_kimi, tmp_path
) -> None:
    assert_passes(attached(layertap_cli, tiny_llama, tmp_path / "llama", sglang_llama, DEFAULT_LAYERS["llama"]))
    assert_passes(
        attached(layertap_cli, tiny_kimi, tmp_path / "kimi", sglang_kimi, KIMI_LAYERS, "--format", "speculators")
    )


def test_sglang_kimi25_store_passes(layertap_cli, sglang_servers, tiny_kimi25, tmp_path) -> None:
    server = sglang_servers(tiny_kimi25, layers=KIMI_LAYERS, extra_args=("--trust-remote-code",))
    assert_passes(attached(layertap_cli, tiny_kimi25, tmp_path / "kimi25", server, KIMI_LAYERS, "--trust-remote-code"),
                  trust_remote_code=True)  # fmt: skip
