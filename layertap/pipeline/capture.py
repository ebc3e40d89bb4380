"""The admit, capture and commit steps: samples -> the engine -> the run's target (files, a stream, or both:
`targets`), several commits in flight.

`admit` lets through the samples the engine takes (a job's max_length may be above its server's limit). The engine
captures a stream of samples (several requests in flight); each capture is committed by a thread of
``commit_threads`` (check, hash, write or rename, put, fsync: they release the GIL) while the engine goes on. The
commit thread owns its capture: it releases it (`Engine.release`) and drops its last reference, so a dump's mapping is
unmapped and its pages freed there, not in the thread that drives the capture and sends the next requests (py-spy
found that work there: the note of gpu_stream.md at 601a115). A sample that fails is retried alone, a bounded number of
times, so one poison sample never fails its batch-mates.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

from layertap.engines.base import Engine
from layertap.errors import LayertapError, RowError, SampleError
from layertap.pipeline.ledger import Committed, Ledger
from layertap.pipeline.plan import RunPlan
from layertap.pipeline.steps import Item
from layertap.pipeline.targets import Target
from layertap.sample import CapturedSample, FailedCapture, TokenizedSample

log = logging.getLogger(__name__)


def admit(items: Iterator[Item], plan: RunPlan, ledger: Ledger) -> Iterator[Item]:
    """The ``todo`` items whose samples go on to the capture: a new sample longer than the engine takes (a stored
    plan's max_length above its server's limit: `RunPlan.on`) is its row's error (kind ``input_limit``); each
    admitted one is counted in the report (truncated, and for a regenerated row its new tokens, cut turns and turns
    re-tokenized otherwise than generated)."""
    limit = plan.engine.input_limit
    for item in items:
        sample = item.sample
        assert sample is not None
        if limit is not None and sample.num_tokens > limit:
            ledger.row_failed(RowError(
                f"{sample.num_tokens} tokens, more than the {limit} the SGLang server accepts (the job's max_length "
                f"{plan.spec.max_length} is above its limit: submit with max_length at most {limit})",
                row=sample.index, sample_id=sample.sample_id, kind="input_limit",
            ))  # fmt: skip
            continue
        ledger.admitted(sample, item.regenerated)
        yield item


@contextmanager
def switch_interval(ms: float) -> Iterator[None]:
    """The interpreter's switch interval at ``ms`` meanwhile (`RunSettings.switch_interval_ms`), then as it was. A
    capture's threads each give up the GIL at every request, lock and Redis or Mooncake call, and wait to take it back
    behind whichever thread runs Python, up to the interval each time: beside one busy thread, a Mooncake reservation
    (three calls of ~0.05 ms) took 18-21 ms at CPython's 5 ms, 1.4 ms at 0.5 ms (the CPU box)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(ms / 1000)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


class Capture:
    """Engine -> target for one stream of samples, with poison samples isolated and retried alone.

    When the engine raises (anything but a ``LayertapError`` other than ``SampleError``), every
    sample it was holding becomes a suspect and is captured again on its own, so one bad sample
    never fails its batch-mates. A capture that fails on its own, or whose commit is refused
    (``SampleError``: non-finite values, wrong shapes), costs that sample one attempt; after
    ``attempts`` it is recorded as failed and the run goes on.
    """

    def __init__(self, engine: Engine, target: Target, ledger: Ledger, *, attempts: int, commit_threads: int) -> None:
        self.engine, self.target, self.ledger = engine, target, ledger
        self.attempts = attempts
        self.tries: Counter[str] = Counter()
        self.alone: list[TokenizedSample] = []
        # Commits (check finiteness, hash, write or rename, fsync) release the GIL, so threads keep the
        # disk busy while the engine runs; at most 2 x threads captured samples wait in memory.
        self.commits = ThreadPoolExecutor(commit_threads, thread_name_prefix="commit")
        self.max_pending = 2 * commit_threads

    def run(self, items: Iterator[Item]) -> None:
        """Capture and commit the samples of ``items`` (``todo`` items with their samples)."""
        samples = (item.sample for item in items if item.sample is not None)
        try:
            while (failure := self._stream(samples)) is not None:
                self.alone.extend(failure[0])  # suspects: captured again alone, not blamed yet
            while self.alone and self.ledger.keep_going():
                sample = self.alone.pop(0)
                if (failure := self._stream(iter([sample]))) is not None:
                    self._attempt_failed(sample, failure[1])
        finally:
            self.commits.shutdown(wait=True)

    def _stream(self, samples: Iterator[TokenizedSample]) -> tuple[list[TokenizedSample], str] | None:
        """Capture and commit until ``samples`` runs out (None) or the engine raises: (held samples, reason)."""
        held: dict[str, TokenizedSample] = {}
        source_error: BaseException | None = None

        def feed() -> Iterator[TokenizedSample]:
            nonlocal source_error
            while self.ledger.keep_going():
                t0 = time.perf_counter()
                try:
                    sample = next(samples)
                except StopIteration:
                    return
                except BaseException as exc:  # the dataset or the store, not the engine: never a suspect
                    source_error = exc
                    raise
                self.ledger.timed("plan", time.perf_counter() - t0)  # the engine's free slots wait meanwhile
                held[sample.sample_id] = sample
                yield sample

        captured = self.engine.capture(feed())
        pending: deque[tuple[Future, TokenizedSample]] = deque()
        try:
            while True:
                try:
                    cap = next(captured)
                except StopIteration:
                    return None
                except Exception as exc:
                    if source_error is not None or (
                        isinstance(exc, LayertapError) and not isinstance(exc, SampleError)
                    ):
                        raise
                    log.warning("engine failed with %d samples in flight: %s: %s", len(held), type(exc).__name__, exc)
                    return list(held.values()), f"{type(exc).__name__}: {exc}"
                held.pop(cap.sample.sample_id, None)
                if isinstance(cap, FailedCapture):
                    self._attempt_failed(cap.sample, cap.reason)
                    continue
                sample, handed = cap.sample, [cap]
                del cap  # the commit thread takes the capture out of ``handed``: its reference is the last
                pending.append((self.commits.submit(self._commit, handed), sample))
                while len(pending) > self.max_pending or (pending and pending[0][0].done()):
                    self._settle(*pending.popleft())
        finally:
            while pending:
                self._settle(*pending.popleft())

    def _commit(self, handed: list[CapturedSample]) -> Committed:
        """The capture in ``handed`` (a list of one, emptied here: once this thread drops it, nothing holds it) into
        the target, timed, then released (in a commit thread)."""
        captured = handed.pop()
        t0 = time.perf_counter()
        try:
            record = self.target.commit(captured)
        finally:
            self.engine.release(captured)
        ended = time.perf_counter()
        return Committed(captured.sample, record, ended - t0, ended)

    def _settle(self, commit: Future, sample: TokenizedSample) -> None:
        """Account for one finished commit (in the calling thread, so the ledger needs no lock)."""
        t0 = time.perf_counter()
        try:
            done = commit.result()
        except SampleError as err:
            self._attempt_failed(sample, str(err))
            return
        finally:  # the run's thread held at the commits' bound: finished requests wait for it meanwhile
            self.ledger.timed("settle", time.perf_counter() - t0)
        self.ledger.committed(done)

    def _attempt_failed(self, sample: TokenizedSample, reason: str) -> None:
        self.tries[sample.sample_id] += 1
        n = self.tries[sample.sample_id]
        log.warning(
            "sample %s (row %d, %d tokens): attempt %d/%d failed: %s",
            sample.sample_id, sample.index, sample.num_tokens, n, self.attempts, reason,
        )  # fmt: skip
        if n < self.attempts:
            self.alone.append(sample)
            return
        self.target.forget(sample.sample_id)
        self.ledger.sample_failed(sample, f"{reason} (failed all {n} attempts)")
