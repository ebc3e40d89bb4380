"""Where a profiled `layertap extract` spent its time, from the raw profiles `scripts/pyspy_sitecustomize.py` records.

    python scripts/pyspy_summary.py PROF_DIR NAME [NAME...]     e.g. NAME = file-tmpfs-plan-1 (its --out folder's name)

For each NAME (``NAME-gil.txt``: the thread holding the GIL; ``NAME-busy.txt``: each thread's non-idle samples) it
prints, in seconds at py-spy's 200 samples a second: the GIL held (imports apart: a process's first imports are no
steady state), each thread's busy time, and where the threads the run's rows go through (its main thread, its
commit and request threads) spent theirs, a few frames below the frame that names the stage.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

RATE = 200  # py-spy's --rate in pyspy_sitecustomize.py
IMPORTS = ("_find_and_load", "importlib")
# thread name prefix -> the frame a stage starts at, and how many frames below it say where the time went
STAGES = {
    "MainThread": ("Capture._stream", 3),
    "commit": ("Capture._commit", 3),
    "sglang-req": ("SGLangEngine._try", 2),
}

Stack = tuple[list[str], int]


def load(path: Path) -> list[Stack]:
    """py-spy's raw (collapsed) lines: ``frame;frame;... count``, frames as ``function (file:line)``."""
    stacks = []
    for line in path.read_text().splitlines():
        frames, _, count = line.rpartition(" ")
        stacks.append(([_short(f) for f in frames.split(";")], int(count)))
    return stacks


def _short(frame: str) -> str:
    """``Run.rows (layertap/pipeline/run.py:137)`` -> ``Run.rows (run.py)``: one name per function, whatever line."""
    return re.sub(r" \((?:.*/)?([^/:]+):\d+\)$", r" (\1)", frame)


def _thread(frame: str) -> str:
    """``thread (3672): commit_3`` -> ``commit`` (a pool's threads as one)."""
    return re.sub(r"_\d+$", "", frame.split(": ", 1)[-1])


def summary(folder: Path, name: str) -> list[str]:
    gil, busy = load(folder / f"{name}-gil.txt"), load(folder / f"{name}-busy.txt")
    imports = sum(n for frames, n in gil if any(m in f for f in frames for m in IMPORTS))
    held = sum(n for _, n in gil)
    lines = [f"## {name}", "", f"GIL held {held / RATE:.2f} s, of which imports {imports / RATE:.2f} s", ""]
    threads: Counter[str] = Counter()
    below: dict[str, Counter[str]] = {thread: Counter() for thread in STAGES}
    for frames, n in busy:
        thread = _thread(frames[0])
        threads[thread] += n
        start, depth = STAGES.get(thread, ("", 0))
        at = [i for i, f in enumerate(frames) if start and f.startswith(start)]
        if at and not any(m in f for f in frames for m in IMPORTS):
            below[thread][" > ".join(frames[at[-1] + 1 : at[-1] + 1 + depth]) or "(its own frame)"] += n
    lines += ["| thread | busy s |", "|---|---|", *(f"| {t} | {n / RATE:.2f} |" for t, n in threads.most_common(8)), ""]
    for thread, where in below.items():
        lines += [f"{thread}, below {STAGES[thread][0]} (imports apart):", ""]
        lines += [f"- {n / RATE:.2f} s {frames}" for frames, n in where.most_common(6)] + [""]
    return lines


if __name__ == "__main__":
    prof = Path(sys.argv[1])
    print("\n".join(line for name in sys.argv[2:] for line in summary(prof, name)))
