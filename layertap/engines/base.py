"""The engine interface: what the pipeline needs from anything that runs the model."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from layertap.engines.server_facts import ServerFacts
from layertap.sample import CapturedSample, FailedCapture, TokenizedSample
from layertap.spec import CaptureSpec

if TYPE_CHECKING:
    from layertap.engines.sglang.session import ServerSession


class Placer(Protocol):
    """Where a capture server may write a sample itself (a stream target's object in its producer's segment, the
    bytes its trainers read: `layertap.pipeline.targets.StreamTarget`), so that no one copies them after."""

    def place(self, sample: TokenizedSample) -> dict[str, Any] | None:
        """The placement to send with ``sample``'s request (`sglang_patch.contract.Placement.param`), the same for
        each of its attempts; None: the server writes a dump of its own."""
        ...


class Engine(ABC):
    """Runs prefills and returns captured states for each sample.

    ``capture`` may reorder and batch internally but yields exactly one result per input sample
    (or raises): a ``CapturedSample`` on the CPU, so the store never touches a device, or a
    ``FailedCapture`` when only that sample's attempt went wrong. The consumer calls ``release``
    on each ``CapturedSample`` once it is committed or refused (files may back its tensors).
    """

    spec: CaptureSpec
    compute_dtype: str  # torch's name of the dtype the states are computed in: the manifest's compute_dtype
    # The server the states come from, as it described itself (checked before any sample); None in process.
    provenance: ServerFacts | None = None
    # The session of the capture server, which writes a regenerated run's responses too; None: in process, none.
    session: ServerSession | None = None
    generation_in_flight: int = 1  # rows regenerating at once on it
    # What each capture request's id begins with (`sglang_patch.contract.format_rid`): its prefix and the job it
    # names; None for an engine that sends no requests (in process).
    rid_prefix: str | None = None
    job: str | None = None
    placer: Placer | None = None  # set by the run whose target takes samples where a server writes them

    @abstractmethod
    def capture(self, samples: Iterable[TokenizedSample]) -> Iterator[CapturedSample | FailedCapture]:
        """Yield one result per input sample, in completion order."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """Facts the manifest records about this engine (name, versions; a server's `ServerFacts.record`)."""

    @property
    def input_limit(self) -> int | None:
        """The longest sample the engine takes, when it is below the model's context length (a server's limit)."""
        return None

    def release(self, captured: CapturedSample) -> None:  # noqa: B027 - in-memory engines hold nothing
        """The consumer is done with ``captured``: free what backs it (e.g. its dump files). Called from the thread
        that committed it, several at once."""

    def close(self) -> None:  # noqa: B027 - engines without resources need nothing here
        """Release the engine's resources (server process, model memory)."""
