"""The stream bench's table of a part its device call's time limit cut short: the runs that ended, and how many of how
many were planned (a part is written, not lost, when ``timeout -s INT`` stops the bench)."""

from __future__ import annotations

from benchmarks.gpu.stream_bench import part_lines


def file_row(rnd: int, seconds: float) -> dict:
    return {"arm": "file-tmpfs", "round": rnd, "samples": 480, "tokens": 312_703, "states": 17.93e9, "seconds": seconds,
            "samples_s": 480 / seconds, "bytes_s": 17.93e9 / seconds, "folder_bytes": 17.94e9, "written_bytes": 0,
            "rows_s": seconds - 1.5, "finish_s": 0.4, "stages": {}}  # fmt: skip


def part(rows: list[dict], planned: int) -> dict:
    return {"layers": 4, "folder_bytes": 3.2e9, "build_s": 15.0, "start_s": 157.0, "arms_s": 60.0,
            "plain_tok_s": None, "in_flight": 16, "rows": rows, "runs_planned": planned}  # fmt: skip


def test_a_part_cut_short_says_how_many_runs_ended_of_how_many() -> None:
    text = "\n".join(part_lines(part([file_row(0, 12.5)], planned=6)))
    assert "stopped by its time limit after 1 of 6 runs" in text
    assert "| file-tmpfs | 38.4 |" in text


def test_a_whole_part_says_nothing_of_a_limit() -> None:
    text = "\n".join(part_lines(part([file_row(0, 12.5), file_row(1, 14.4)], planned=2)))
    assert "stopped" not in text and "medians of 2 rounds;" in text


def test_a_stream_arm_is_rated_as_the_table_rates_it_and_round_by_round_against_its_own_file_run() -> None:
    stream = [{**file_row(rnd, seconds), "arm": "only-disk", "put_s": 4.0, "held_s": 0.0,
               "consumer": {"bytes": 17.93e9, "receive_s": 14.0, "consumers": 2, "to_device_s": 1.0, "ack_s": 0.6,
                            "span_s": 9.0}}
              for rnd, seconds in ((0, 14.0), (1, 20.0))]  # fmt: skip
    text = "\n".join(part_lines(part([file_row(0, 14.0), stream[0], file_row(1, 16.0), stream[1]], planned=4)))
    # the table's ratio: the medians of samples/s (of two rounds: their means), (34.29 + 24.0) / (34.29 + 30.0)
    assert "| only-disk | 29.1 | 1.09 | 0.91 |" in text
    assert "- only-disk: 0.91 of the file run to tmpfs (file-tmpfs; each round against its own: 1.00, 0.80)" in text
