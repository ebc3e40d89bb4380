"""``ServerSession``: one per server handle, the one way this process talks to a capture server.

It holds the HTTP client, reads the server's facts and checks them before any request (`server_facts`), and keeps
the one policy for a request the server dropped (no answer, HTTP 5xx, or a death before the request's dump was
written), for the capture's prefills and a regenerating run's generations alike (`until_served`): the request is
sent again once the server serves (`_recover`: an owned server that died is restarted, within its restart budget,
and checked again; a server given by URL that still answers is checked again, one that does not ends the run:
someone else runs it). A drop is not the request's fault and costs its sample or row none of its attempts, unless
the server keeps dropping it while it stays up (`SERVER_DOWN_TRIES`): then the try failed (SampleError), as any
other failed try of that sample or row.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import httpx

from layertap.engines.server_facts import ServerExpectation, ServerFacts, check_server
from layertap.engines.sglang.process import SGLangServer
from layertap.errors import SampleError, ServerError

log = logging.getLogger(__name__)
T = TypeVar("T")

# Resends of one request a server dropped while it stayed up, before the try counts as failed.
SERVER_DOWN_TRIES = 3


class ServerDown(Exception):
    """The server dropped a request (connection refused or reset, HTTP 5xx, no dump after its answer): not the
    request's fault; `ServerSession.until_served` sends it again once the server serves."""


class ServerSession:
    """The HTTP client, the identity check and the recovery of one SGLang server; thread-safe (the capture's and the
    generation's request threads share it)."""

    def __init__(
        self,
        server: SGLangServer,
        *,
        expected: ServerExpectation | None = None,
        request_timeout_s: float = 3600.0,
        max_restarts: int = 3,
    ) -> None:
        """Reads the server's facts and refuses it (ServerError, one line) unless it meets ``expected`` (None: a
        session that only generates, with nothing to check it against). ``max_restarts`` bounds the restarts of an
        owned server over the session's life."""
        self.server = server
        self.expected = expected
        self.max_restarts = max_restarts
        self._client = httpx.Client(timeout=httpx.Timeout(request_timeout_s, connect=10.0))
        self._recovering = threading.Lock()  # one restart at a time: threads that saw one death wait for it
        try:
            self.facts: ServerFacts = self._checked_facts()
        except ServerError:
            self._client.close()
            raise

    @property
    def url(self) -> str:
        return self.server.url

    def check(self) -> None:
        """Read the server's facts again and refuse it unless it is still the run's server with the settings it had
        (a server given by URL may have been restarted with another model by whoever runs it)."""
        self.facts = self._checked_facts(self.facts)

    def _checked_facts(self, pinned: ServerFacts | None = None) -> ServerFacts:
        """The server's facts as it reports them now (``/server_info``; ``/get_server_info`` on older SGLang), refused
        unless they meet the expectation and, when ``pinned``, keep those settings."""
        for endpoint in ("/server_info", "/get_server_info"):
            try:
                reply = self._client.get(self.url + endpoint, timeout=60.0)
            except httpx.TransportError as exc:
                raise ServerError(f"the SGLang server at {self.url} does not answer {endpoint}: {exc}") from exc
            if reply.status_code != 404:
                break
        if reply.status_code != 200:
            raise ServerError(f"the SGLang server at {self.url} answered {endpoint} with HTTP {reply.status_code}")
        facts = ServerFacts.from_info(self.url, reply.json())
        if self.expected is not None:
            check_server(facts, self.expected, pinned)
        return facts

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        """``POST`` ``body`` to ``path``: the reply (below HTTP 500), or ServerDown when the server dropped it."""
        try:
            reply = self._client.post(self.url + path, json=body)
        except httpx.TransportError as exc:
            raise ServerDown(f"{type(exc).__name__}: {exc}") from exc
        if reply.status_code >= 500:
            raise ServerDown(f"HTTP {reply.status_code}: {reply.text[:300]}")
        return reply

    def until_served(self, one_try: Callable[[], T]) -> T:
        """``one_try()`` (one request, raising ServerDown when the server dropped it), again after each drop once the
        server serves (`_recover`); SampleError once it was dropped more than `SERVER_DOWN_TRIES` times while the
        server stayed up, ServerError when the server cannot serve again."""
        drops = 0
        while True:
            restarts = self.server.restarts
            try:
                return one_try()
            except ServerDown as exc:
                reason = str(exc)
            drops += 1
            if drops > SERVER_DOWN_TRIES and self.server.alive():
                raise SampleError(f"the server kept dropping this request ({drops} times, up meanwhile): {reason}")
            self._recover(reason, restarts)

    def _recover(self, reason: str, restarts: int) -> None:
        """The server dropped a request (``reason``) sent while it had been restarted ``restarts`` times: return once
        it serves again, restarting it if it is down and ours, within the restart budget, and checking it again;
        ServerError otherwise, naming how it ended and the decisive line of its log (the exception that killed it).
        A request sent before a restart that another thread made meanwhile goes again at once: that server was started
        and checked, whereas a ``/health`` probe (a generation SGLang queues behind the resent requests) for each such
        request in turn under the lock held the last of them a second each; one dead again drops it again."""
        with self._recovering:
            if self.server.owned and self.server.restarts != restarts:
                return
            if not self.server.owned:
                if not self.server.alive():
                    raise ServerError(
                        f"the SGLang server at {self.url} is down ({reason}). It was given by URL, so layertap does "
                        "not restart it: restart it and run again (committed samples are kept)"
                    )
                self.check()
                return
            if self.server.alive():
                return
            ended, restarts = self.server.ended(), self.server.restarts
            if restarts >= self.max_restarts:
                raise ServerError(
                    self.server.failure(f"{ended}, down again after {restarts} restart{'s' * (restarts != 1)}")
                )
            log.warning("%s\nrestarting it and resending its requests", self.server.failure(ended))
            self.server.restart()
            self.check()

    def close(self) -> None:
        """Close the client (the server itself is its owner's to stop)."""
        self._client.close()
