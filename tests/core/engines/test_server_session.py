"""One policy for a dropped request, the server's `ServerSession`'s, for a capture's prefills and a regenerating run's
generations alike: a stand-in server that drops every request costs a sample's capture and a row's generation one
attempt each after the same number of resends; one that goes away, attached by URL, ends both with the same
ServerError; a real CPU server this process launched, SIGKILLed while it holds generations and then while it holds
captures, is restarted once each through the one session, and neither costs its samples or rows an attempt."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from harness.sglang import cpu_server_env
from layertap.data.chat import ChatTokenizer
from layertap.data.rows import parse_row
from layertap.engines.sglang.engine import SGLangEngine
from layertap.engines.sglang.launch import ServerConfig
from layertap.engines.sglang.process import SGLangServer
from layertap.engines.sglang.session import SERVER_DOWN_TRIES, ServerSession
from layertap.errors import RowError, ServerError
from layertap.models.folder import ModelFolder
from layertap.regenerate import GenerationSettings, Regenerated, Regenerator, RowJob
from layertap.sample import CapturedSample, FailedCapture, TokenizedSample
from layertap.spec import resolve_capture
from tests.core.datasets import conversation_rows
from tests.core.engines.test_server_identity import _info
from tests.sglang_fixtures import DEFAULT_LAYERS, TEST_SERVER_ARGS

LAYERS = DEFAULT_LAYERS["llama"]


@contextmanager
def dropping_server(info: dict[str, Any], *, vanish: bool = False) -> Iterator[tuple[str, list[str]]]:
    """A stand-in capture server that is healthy, describes itself with ``info`` and drops every ``/generate``: it
    answers HTTP 503, or with ``vanish`` goes away (stops listening, closes the connection unanswered). Yields its
    URL and the rids of the requests it dropped."""
    dropped: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._send(200, info if self.path == "/server_info" else {})

        def do_POST(self) -> None:
            dropped.append(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["rid"])
            if vanish:
                http.shutdown()
                http.server_close()
                self.close_connection = True
                return
            self._send(503, {"error": "overloaded"})

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{http.server_address[1]}", dropped
    finally:
        http.shutdown()
        thread.join()
        http.server_close()


@contextmanager
def engine_and_regenerator(
    server: SGLangServer, model: Path, dump_root: Path, *, attempts: int
) -> Iterator[tuple[SGLangEngine, Regenerator]]:
    """An SGLang engine on ``server`` capturing the tiny Llama's test layers, and a Regenerator on its session."""
    folder = ModelFolder.read(model)
    capture = resolve_capture(list(LAYERS), convention="capture", num_layers=6, final="both")
    engine = SGLangEngine(server, capture, folder=folder, dump_root=dump_root, job="t", in_flight=4)
    regen = Regenerator(engine.session, ChatTokenizer(folder.load_tokenizer()),
                        GenerationSettings(mode="last", max_new_tokens=8), job="t", attempts=attempts, in_flight=4)  # fmt: skip
    try:
        yield engine, regen
    finally:
        regen.close()
        engine.close()


def _sample(i: int = 0) -> TokenizedSample:
    return TokenizedSample(f"s{i}", i, torch.arange(4, 40 + i), torch.ones(36 + i, dtype=torch.uint8))


def _job(number: int, row: dict) -> RowJob:
    return RowJob(number, row["id"], parse_row(number, row))


def test_a_request_dropped_again_and_again_costs_a_capture_and_a_generation_one_attempt_after_as_many_resends(
    tiny_llama, tmp_path
) -> None:
    row = conversation_rows(1, seed=3, max_words=6)[0]
    with (
        dropping_server(_info(tiny_llama, tmp_path)) as (url, dropped),
        engine_and_regenerator(SGLangServer(url=url), tiny_llama, tmp_path, attempts=1) as (engine, regen),
    ):
        (failed,) = engine.capture([_sample()])
        captures = dropped[:]
        dropped.clear()
        (refused,) = regen.regenerate_many([_job(0, row)])
    assert isinstance(failed, FailedCapture) and "the server kept dropping this request" in failed.reason
    assert isinstance(refused, RowError) and refused.kind == "generation"
    assert "the server kept dropping this request" in refused.reason and "failed all 1 attempts" in refused.reason
    # Sent once and again SERVER_DOWN_TRIES times, each time under a rid of its own.
    assert len(captures) == len(set(captures)) == len(dropped) == len(set(dropped)) == 1 + SERVER_DOWN_TRIES


def test_a_server_given_by_url_that_goes_away_ends_a_capture_and_a_generation_with_one_error(
    tiny_llama, tmp_path
) -> None:
    row = conversation_rows(1, seed=3, max_words=6)[0]
    said = []
    with (
        dropping_server(_info(tiny_llama, tmp_path), vanish=True) as (url, dropped),
        engine_and_regenerator(SGLangServer(url=url), tiny_llama, tmp_path, attempts=3) as (engine, regen),
    ):
        for run in (lambda: list(engine.capture([_sample()])), lambda: list(regen.regenerate_many([_job(0, row)]))):
            with pytest.raises(ServerError) as info:
                run()
            said.append(str(info.value))
    assert len(dropped) == 1  # the capture's request; the generation's found no server
    for message in said:
        assert message.startswith(f"the SGLang server at {url} is down (")
        assert "It was given by URL, so layertap does not restart it" in message


def _freeze_then_kill_at_next_post(session: ServerSession, killed: threading.Event) -> None:
    """Make the session's next ``POST`` reach a frozen server (SIGSTOP) that is SIGKILLed while it holds it."""
    post = session.post
    server = session.server

    def held_then_killed(path: str, body: dict[str, Any]) -> httpx.Response:
        if not killed.is_set():
            killed.set()
            os.killpg(server._proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
            threading.Timer(0.5, server.kill).start()
        return post(path, body)

    session.post = held_then_killed  # type: ignore[method-assign]


@pytest.mark.sglang
def test_an_owned_server_sigkilled_mid_generation_and_mid_capture_is_restarted_once_each_by_its_session(
    tiny_llama, cuda_stub_dir, sglang_python, tmp_path, caplog
) -> None:
    config = ServerConfig(python=sglang_python, model=tiny_llama, dump_root=tmp_path / "dumps", layers=LAYERS,
                          final="both", log_path=tmp_path / "server.log", sglang_args=TEST_SERVER_ARGS,
                          env=cpu_server_env(cuda_stub_dir), start_backoff_s=0.5)  # fmt: skip
    server = SGLangServer(config)
    server.start()
    rows = conversation_rows(8, seed=4, max_words=12)
    restarts = []
    generated, captured_ = threading.Event(), threading.Event()
    with (
        caplog.at_level(logging.WARNING),
        engine_and_regenerator(server, tiny_llama, config.dump_root, attempts=1) as (engine, regen),
    ):
        _freeze_then_kill_at_next_post(engine.session, generated)
        regenerated = list(regen.regenerate_many(_job(i, r) for i, r in enumerate(rows)))
        restarts.append(server.restarts)
        _freeze_then_kill_at_next_post(engine.session, captured_)
        captured = list(engine.capture([_sample(i) for i in range(8)]))
        restarts.append(server.restarts)
    assert generated.is_set() and captured_.is_set()
    assert all(isinstance(r, Regenerated) for r in regenerated), regenerated
    assert all(isinstance(c, CapturedSample) for c in captured), [c for c in captured if isinstance(c, FailedCapture)]
    assert restarts == [1, 2]  # one restart for each death, however many requests it dropped
    warned = [r for r in caplog.records if "restarting it and resending its requests" in r.getMessage()]
    assert [r.name for r in warned] == ["layertap.engines.sglang.session"] * 2  # the one session's path, both times
    assert not [r for r in caplog.records if "generation attempt" in r.getMessage()]  # no death cost an attempt
