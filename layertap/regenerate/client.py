"""Regenerate a conversation's assistant turns with SGLang's native ``/generate``, many rows in flight.

Per row (`Regenerator.regenerate`): for each turn of `turns_to_regenerate`, in order, the template renders the
messages before it with its generation prompt and the row's tools (system, user and tool turns and the assistant
turns that call tools as given; earlier answers as given for ``last``, as regenerated for ``all``): HF's
``apply_chat_template(messages[:i], tools=..., add_generation_prompt=True)``, tokenized as `ChatTokenizer` does; the
ids are sent as ``input_ids`` with the run's sampling settings, the turn's seed and the template's end-of-turn token
as a stop token, and the generated ids become the new assistant message (`TurnFormat.message`). Rows run in threads
(`Regenerator.regenerate_many`), the turns of one row one after another.

The server is the capture server, and its `ServerSession` the capture's own: a generation rid (`generation_rid`)
holds no ``:``, so the plugin captures none of its passes; generation may take prefixes from the radix cache (the
launcher turns it off unless told to keep it; the capture requests that follow bring their own unique
``extra_key``).

Failures follow the capture's rules: a row with nothing to regenerate, or one the server refuses (HTTP 4xx, e.g. a
prompt past the context length), is a RowError (kinds ``regenerate``, ``generation``); an aborted generation (a
SampleError) costs the row one of its ``attempts`` (the row is regenerated again), and after the last it is the row's
RowError (``generation``); a request the server dropped is sent again by the session's one policy
(`ServerSession.until_served`: an owned server that died is restarted, a dead attached one is a ServerError; a request
dropped again and again while the server stays up is an aborted generation).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import httpx

from layertap.data.chat import ChatTokenizer
from layertap.data.rows import Conversation, ParsedRow
from layertap.engines.sglang.session import ServerSession
from layertap.errors import RowError, SampleError
from layertap.regenerate.turns import (
    GeneratedTurn,
    Regenerated,
    TurnFormat,
    turn_seed,
    turns_to_regenerate,
)
from layertap.spec import GenerationSettings
from sglang_patch.contract import generation_rid

log = logging.getLogger(__name__)

# The rows of one round of a run, in batches in flight (`Regenerator.ahead`: the run regenerates a round whole, then
# captures it). Each round ends with its last rows decoding in a shrinking batch: at 16 batches that tail is a few
# percent of the round.
AHEAD_BATCHES = 16


@dataclass(frozen=True, slots=True)
class RowJob:
    """One row to regenerate: ``row``, its number in the dataset (0-based), its sample id and the parsed row."""

    row: int
    sample_id: str
    parsed: ParsedRow


class Regenerator:
    """Regenerates rows through one server's `ServerSession` with one chat template, ``in_flight`` rows at once on
    threads that live as long as it (`close`)."""

    def __init__(
        self,
        session: ServerSession,
        chat: ChatTokenizer,
        settings: GenerationSettings,
        *,
        job: str,
        attempts: int = 1,
        in_flight: int = 16,
    ) -> None:
        """``job`` names the run in the generation rids (for the server's log); ``attempts`` per row (as a sample's
        captures); ``in_flight`` rows at once."""
        self.session = session
        self.chat = chat
        self.settings = settings
        self.job = job
        self.attempts = attempts
        self.in_flight = in_flight
        self.ahead = AHEAD_BATCHES * in_flight  # the rows of one round of a run
        self.format = TurnFormat.of(chat)
        self.stop_token_ids = self.format.stop_token_ids(chat)
        self._pool = ThreadPoolExecutor(in_flight, thread_name_prefix="regenerate")
        self._span_lock = threading.Lock()
        self._span: tuple[float, float] | None = None  # monotonic: this call's first request sent, its last reply
        self._spent = 0.0  # the spans of the `regenerate_many` calls before

    @property
    def seconds(self) -> float:
        """Wall seconds generating: from each `regenerate_many` call's first request to its last reply, summed."""
        with self._span_lock:
            return self._spent + (self._span[1] - self._span[0] if self._span else 0.0)

    def regenerate(self, job: RowJob) -> Regenerated:
        """The row with its turns regenerated (see the module doc); raises RowError, SampleError, ServerError."""
        indices = turns_to_regenerate(job.parsed, self.settings.mode, row=job.row, sample_id=job.sample_id)
        assert isinstance(job.parsed, Conversation)  # turns_to_regenerate refuses the other shapes
        messages = list(job.parsed.messages)
        turns = []
        for index in indices:
            conv = Conversation(messages, job.parsed.tools)
            where = {"row_number": job.row, "sample_id": job.sample_id}
            prompt = self.chat.encode(self.chat.render_messages(conv, index, generation_prompt=True, **where), **where)
            turn = self._generate(job, index, prompt)
            messages[index] = self.format.message(self.chat, prompt, turn.output_ids, turn.finish_reason)
            turns.append(turn)
        return Regenerated(job.sample_id, Conversation(messages, job.parsed.tools), tuple(turns))

    def _generate(self, job: RowJob, index: int, prompt: list[int]) -> GeneratedTurn:
        s = self.settings
        seed = turn_seed(s.seed or 0, job.sample_id, index)
        params: dict[str, Any] = {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p,
                                  "stop_token_ids": self.stop_token_ids, "sampling_seed": seed}  # fmt: skip
        sent = time.monotonic()
        rid, reply = self._send(job, index, {"input_ids": prompt, "sampling_params": params})
        with self._span_lock:
            first = self._span[0] if self._span else sent
            self._span = (min(first, sent), time.monotonic())
        if reply.status_code != 200:
            reason = f"the server refused to generate turn {index} ({len(prompt)} prompt tokens): {reply.text[:300]}"
            raise RowError(reason, row=job.row, sample_id=job.sample_id, kind="generation")
        body = reply.json()
        finish = body["meta_info"].get("finish_reason") or {}
        kind = finish.get("type") if isinstance(finish, dict) else None
        if kind not in ("stop", "length"):
            raise SampleError(f"generation {rid} ended with {finish!r}")
        # SGLang keeps the stop token it matched as the last output id (Req.finished_len), as HF generate does.
        output = list(body["output_ids"])
        return GeneratedTurn(index, prompt, output, kind, seed)

    def _send(self, job: RowJob, index: int, body: dict[str, Any]) -> tuple[str, httpx.Response]:
        """``POST /generate`` of ``body`` under a fresh rid for each try, until the server answers (below HTTP 500):
        (rid, reply). A dropped request follows the session's policy (`ServerSession.until_served`)."""

        def one_try() -> tuple[str, httpx.Response]:
            rid = generation_rid(self.job, job.sample_id, index, uuid.uuid4().hex[:12])
            return rid, self.session.post("/generate", {**body, "rid": rid})

        return self.session.until_served(one_try)

    def _attempt_failed(self, job: RowJob, error: SampleError, tries: Counter[str]) -> RowError | None:
        """Count a failed generation of ``job``'s row: None while it has attempts left (regenerate it again), else
        its RowError."""
        tries[job.sample_id] += 1
        n = tries[job.sample_id]
        log.warning("row %d (sample %s): generation attempt %d/%d failed: %s",
                    job.row, job.sample_id, n, self.attempts, error)  # fmt: skip
        if n < self.attempts:
            return None
        reason = f"{error} (failed all {n} attempts)"
        return RowError(reason, row=job.row, sample_id=job.sample_id, kind="generation")

    def regenerate_many(self, jobs: Iterable[RowJob]) -> Iterator[Regenerated | RowError]:
        """Each row regenerated, ``in_flight`` at once, yielded in completion order; a row's refusal is yielded
        as its RowError, as is a row whose generation failed all its ``attempts`` (kind ``generation``; one that has
        attempts left is regenerated again). ServerError propagates (after the rows in flight end).

        ``jobs`` is taken whole at once (a run hands one round, `ahead` rows): the server decodes every row of it
        without waiting for the caller."""
        pending = {self._pool.submit(self.regenerate, job): job for job in jobs}
        tries: Counter[str] = Counter()  # failed generations per sample id
        try:
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    job = pending.pop(fut)
                    try:
                        yield fut.result()
                    except RowError as exc:
                        yield exc
                    except SampleError as exc:
                        if (failed := self._attempt_failed(job, exc, tries)) is not None:
                            yield failed
                        else:
                            pending[self._pool.submit(self.regenerate, job)] = job
        finally:
            for fut in pending:
                fut.cancel()
            wait(pending)
            with self._span_lock:
                self._spent += self._span[1] - self._span[0] if self._span else 0.0
                self._span = None

    def close(self) -> None:
        """End the generation threads (the session is its engine's to close)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
