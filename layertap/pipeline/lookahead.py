"""The row planner's steps run ahead in processes of their own (``--plan-processes``).

Identify, parse and tokenize are pure Python: a chat template, and often a Python tokenizer (with Kimi-K2.5's tiktoken
wrapper, 6.9 ms a row on the CPU box). In the run's process they hold the GIL its request and commit threads need, on
the thread that also takes every capture and hands it to a commit: on an H100 that thread ran at 62% of a core, half
the host idle, while finished requests waited 58-85 ms each for it (benchmarks/results/gpu_stream_stages.md).

`Lookahead` plans up to ``ahead`` rows in a pool of processes, each outcome sent back pickled, in row order. Until the
pool's first process is ready (it imports torch and loads the tokenizer) rows are planned in the run's process, so a
short run does not wait on the pool; a pool that breaks (a process killed) leaves the rest to the run's process, which
plans them as it would have.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import forkserver
from typing import Any

from layertap.errors import LayertapError

log = logging.getLogger(__name__)
Outcome = Any  # `RowPlanner.outcome`'s: a TokenizedSample, a RowJob or a RowError
_outcome: Callable[[int, Any], Outcome] | None = None  # a pool process's planner's `outcome`


def prepare() -> None:
    """Start the forkserver the planning processes fork from, its imports (torch, the tokenizers) made once, while the
    run starts (its scan, its server): the pool's first process is then ready about when its tokenizer is loaded."""
    multiprocessing.get_context("forkserver").set_forkserver_preload([f"{__package__}.rows"])
    forkserver.ensure_running()


def _start(make: bytes) -> None:
    """A pool process's planner, made once (its tokenizer loaded) from what ``make`` pickles: a function and its
    arguments."""
    global _outcome
    build, args = pickle.loads(make)
    _outcome = build(*args).outcome


def _plan(row: int, data: Any) -> bytes:
    """One row's outcome, pickled here with plain pickle: its tensors go back as bytes in the result, not as
    shared-memory handles (torch's reductions for multiprocessing)."""
    assert _outcome is not None
    return pickle.dumps(_outcome(row, data))


def _ready() -> None:
    return None


class Lookahead:
    """Rows' outcomes from ``processes`` processes, ``ahead`` rows ahead of the caller; ``outcome`` plans a row in
    this process (before the pool is ready, or once it broke); ``make`` = (function, arguments) that builds the same
    planner in a pool process."""

    def __init__(self, outcome: Callable[[int, Any], Outcome], make: tuple, *, processes: int, ahead: int) -> None:
        self.outcome, self.ahead = outcome, ahead
        self.planned = {"ahead": 0, "here": 0}  # rows planned by the pool, and in this process
        prepare()  # forkserver: a fork of this process (its threads, a Mooncake client's among them) could deadlock
        self.pool: ProcessPoolExecutor | None = ProcessPoolExecutor(
            processes, mp_context=multiprocessing.get_context("forkserver"), initializer=_start,
            initargs=(pickle.dumps(make),),
        )  # fmt: skip
        self.warm = self.pool.submit(_ready)

    def outcomes(self, rows: Iterable[tuple[int, Any]]) -> Iterator[tuple[int, Any, Outcome]]:
        """``(row, data, outcome)`` of each of ``rows``, in order."""
        window: deque[tuple[int, Any, Future | None]] = deque()
        for row, data in rows:
            window.append((row, data, self._submit(row, data)))
            while window and (window[0][2] is None or len(window) > self.ahead):
                yield self._take(*window.popleft())
        while window:
            yield self._take(*window.popleft())

    def close(self) -> None:
        """Stop the pool (rows it planned and no one took are dropped)."""
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None

    def _submit(self, row: int, data: Any) -> Future | None:
        """The row sent to the pool once it is ready; None: this process plans it."""
        if self.pool is None or not self.warm.done():
            return None
        try:
            return self.pool.submit(_plan, row, data)
        except BrokenProcessPool as exc:
            self._broken(exc)
            return None

    def _take(self, row: int, data: Any, planned: Future | None) -> tuple[int, Any, Outcome]:
        """The row's outcome: the pool's, else (not sent, or the pool failed it) planned here, where a dataset-wide
        error raises as it would have."""
        if planned is not None:
            try:
                outcome = pickle.loads(planned.result())
                self.planned["ahead"] += 1
                return row, data, outcome
            except BrokenProcessPool as exc:
                self._broken(exc)
            except LayertapError:
                raise
            except Exception as exc:  # not the row's: e.g. an outcome that would not pickle
                log.warning("row %d: planning it ahead failed (%s: %s); planned here", row, type(exc).__name__, exc)
        self.planned["here"] += 1
        return row, data, self.outcome(row, data)

    def _broken(self, exc: BaseException) -> None:
        if self.pool is not None:
            log.warning("the processes planning rows ahead broke (%s); this process plans the rest", exc)
        self.close()
