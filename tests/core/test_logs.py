"""One log format, and -v/--verbose: what a run decides shows with -v and stays quiet without it."""

import logging
import re
import subprocess

from layertap.logs import level_for
from tests.core.datasets import conversation_rows, write_jsonl

LINE = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO layertap\.pipeline\.plan: dataset .*: 6 rows, sha256 [0-9a-f]{64}$"
)


def _extract(cli, tiny_llama, tmp_path, *verbose: str) -> subprocess.CompletedProcess[str]:
    data = write_jsonl(tmp_path / "chats.jsonl", conversation_rows(6, seed=3))
    return cli(*verbose, "extract", "--model", tiny_llama, "--data", data, "--layers", "1,3,5",
               "--out", tmp_path / f"out{len(verbose)}")  # fmt: skip


def test_verbose_shows_the_runs_info_lines_in_the_one_format_and_quiet_hides_them(
    layertap_cli, tiny_llama, tmp_path
) -> None:
    quiet, verbose = _extract(layertap_cli, tiny_llama, tmp_path), _extract(layertap_cli, tiny_llama, tmp_path, "-v")
    assert quiet.returncode == verbose.returncode == 0, (quiet.stderr[-2000:], verbose.stderr[-2000:])
    assert not any(LINE.match(line) for line in quiet.stderr.splitlines()), quiet.stderr[-2000:]
    assert any(LINE.match(line) for line in verbose.stderr.splitlines()), verbose.stderr[-2000:]


def test_each_v_is_one_level_down_from_the_default_and_debug_is_the_floor() -> None:
    assert [level_for(v) for v in range(4)] == [logging.WARNING, logging.INFO, logging.DEBUG, logging.DEBUG]
    assert level_for(0, default=logging.INFO) == logging.INFO and level_for(1, default=logging.INFO) == logging.DEBUG
