"""The CLI's progress bar: samples, tokens/s (and generated tokens/s when regenerating) and ETA on one line (rich)."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn, TimeRemainingColumn
from rich.text import Text


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


class RichProgress:
    """A ``ProgressSink`` that draws a rich bar; already-done samples count as completed."""

    def __init__(self, console: Console | None = None) -> None:
        self._progress = Progress(
            TextColumn("[bold]extract"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("samples"),
            _TokensPerSecond(),
            _GeneratedPerSecond(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
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
