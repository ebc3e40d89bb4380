"""One log format for every process layertap runs: the CLI, the coordinator and the Celery workers.

The CLI logs warnings by default (its progress bar is the thing to watch) and more with ``-v`` (info) or
``-vv`` (debug); the coordinator and the workers, which are services, log info by default.
"""

from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def level_for(verbose: int, *, default: int = logging.WARNING) -> int:
    """The level ``-v`` counted ``verbose`` times asks for: each one a step below ``default`` (at least debug)."""
    return max(logging.DEBUG, default - 10 * verbose)


def configure_logging(level: int) -> None:
    """Send every logger's records at ``level`` and above to stderr in ``LOG_FORMAT`` (replacing earlier handlers,
    so that a library's own set-up does not leave a second format behind)."""
    logging.basicConfig(level=level, format=LOG_FORMAT, force=True)
