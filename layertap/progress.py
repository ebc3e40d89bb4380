"""The CLI's progress bar: samples, tokens/s (and generated tokens/s when regenerating) and ETA on one line (rich);
a streaming run's samples put, acked and in flight on a line below it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from rich.console import Console, RenderableType
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn, TimeRemainingColumn
from rich.text import Text

from layertap.state.model import StreamView


class _TokensPerSecond(ProgressColumn):
    def render(self, task: Task) -> Text:
        elapsed = time.monotonic() - task.fields["t0"]
        rate = task.fields["tokens"] / elapsed if elapsed > 0 else 0.0
        return Text(f"{rate:,.0f} tok/s", style="cyan")


class _GeneratedPerSecond(ProgressColumn):
    """A regenerating run's generated tokens/s (blank for a run that captures its rows as given)."""

    def render(self, task: Task) -> Text:
        if not task.fields["generated"]:
            return Text("")
        elapsed = time.monotonic() - task.fields["t0"]
        return Text(f"{task.fields['generated']:,} generated, {task.fields['generated'] / elapsed:,.0f} tok/s",
                    style="magenta")  # fmt: skip


STREAM_STATES = {"putting": "putting", "held": "held at the bound", "paused": "paused (its job cancelled)",
                 "draining": "waiting for the last acks", "done": "every one acked"}  # fmt: skip


def stream_line(view: StreamView) -> str:
    """One stream's producer as the CLI tells it: put, acked, dead-lettered (when any), in flight against its bound,
    what it does, and how long it waited at the bound (its consumers behind)."""
    dead = f"{view.dead:,} dead-lettered, " if view.dead else ""
    state = "every one settled, not all delivered" if view.state == "done" and view.dead else STREAM_STATES[view.state]
    return (f"stream {view.name}: {view.put:,} put, {view.acked:,} acked, {dead}{view.in_flight:,} in flight (bound "
            f"{view.bound:,}), {state}, held {view.held_s:,.1f}s")  # fmt: skip


class _Progress(Progress):
    """rich's ``Progress`` with a streaming run's line under its bar."""

    def __init__(self, *columns: ProgressColumn, stream: Callable[[], StreamView] | None, **options: object) -> None:
        self.stream = stream  # before rich's __init__, which renders once
        super().__init__(*columns, **options)  # type: ignore[arg-type]

    def get_renderables(self) -> Iterable[RenderableType]:
        yield from super().get_renderables()
        if self.stream is not None:
            yield Text(stream_line(self.stream()), style="blue")


class RichProgress:
    """A ``ProgressSink`` that draws a rich bar; already-done samples count as completed. ``stream``: the view of a
    streaming run's producer (`layertap.stream.sink.MooncakeSink.view`), drawn under the bar."""

    def __init__(self, console: Console | None = None, stream: Callable[[], StreamView] | None = None) -> None:
        self._progress = _Progress(
            TextColumn("[bold]extract"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("samples"),
            _TokensPerSecond(),
            _GeneratedPerSecond(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            stream=stream,
        )
        self._task = None

    def start(self, total: int, already_done: int) -> None:
        self._progress.start()
        self._task = self._progress.add_task(
            "extract", total=total, completed=already_done, tokens=0, generated=0, t0=time.monotonic()
        )

    def advance(self, samples: int, tokens: int) -> None:
        task = self._progress.tasks[0]
        self._progress.update(self._task, advance=samples, tokens=task.fields["tokens"] + tokens)

    def generated(self, tokens: int) -> None:
        task = self._progress.tasks[0]
        self._progress.update(self._task, generated=task.fields["generated"] + tokens)

    def stop(self) -> None:
        self._progress.stop()
