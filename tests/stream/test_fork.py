"""A Mooncake client is refused, in one line, in a process forked from one that had made a client (its setup there
hangs: a DataLoader worker forked after an in-process read did), against a real ``mooncake_master``; a process started
from a forkserver sets one up."""

from __future__ import annotations

import multiprocessing
from multiprocessing.queues import Queue

import pytest

from harness.mooncake import MooncakeMaster
from layertap.stream.mooncake import StreamError, connect, disconnect


def connect_once(address: str, said: Queue) -> None:
    """A consumer's client set up and closed in this (child) process; what happened put on ``said``."""
    try:
        disconnect(connect(address, segment_bytes=0))
        said.put("connected")
    except StreamError as exc:
        said.put(str(exc))


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_a_client_in_a_process_forked_after_one_is_refused_in_one_line(
    mooncake_master: MooncakeMaster, start: str
) -> None:
    disconnect(connect(mooncake_master.address, segment_bytes=0))  # this process has made one
    context = multiprocessing.get_context(start)
    said = context.Queue()
    child = context.Process(target=connect_once, args=(mooncake_master.address, said))
    child.start()
    try:
        told = said.get(timeout=120)  # a hang, not a refusal, would end here
    finally:
        child.join(timeout=60)
        child.kill()
    if start == "fork":
        assert told.startswith("this process was forked from one that had made a Mooncake client"), told
    else:
        assert told == "connected"
