"""Pure capture logic with plain tensors: pass planning and per-rid accumulation."""

from __future__ import annotations

import pytest
import torch

from sglang_patch.capture import Accumulator, Completed, Failed, Outcome, Piece, Prompts, plan_pass
from sglang_patch.contract import format_rid

H, K = 8, 2


def rid(sample: str) -> str:
    return format_rid("job", sample, 0)


def make_truth(lengths: dict[str, int], seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """Per request, the states a perfect capture would give: input_ids [T], aux [T, K, H], final [T, H]."""
    g = torch.Generator().manual_seed(seed)
    return {
        r: {
            "input_ids": torch.randint(0, 1000, (t,), generator=g),
            "aux": torch.randn(t, K, H, generator=g),
            "final_post": torch.randn(t, H, generator=g),
        }
        for r, t in lengths.items()
    }


def pass_rows(
    segments: list[tuple[str, int, int]], truth: dict[str, dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """Concatenate each segment (rid, position, n) of a pass as SGLang packs it; foreign rids get noise."""
    parts: dict[str, list[torch.Tensor]] = {"input_ids": [], "aux": [], "final_post": []}
    for r, position, n in segments:
        source = truth.get(r) or {
            "input_ids": torch.full((position + n,), -1),
            "aux": torch.full((position + n, K, H), 99.0),
            "final_post": torch.full((position + n, H), 99.0),
        }
        for name, chunks in parts.items():
            chunks.append(source[name][position : position + n])
    return {name: torch.cat(chunks) for name, chunks in parts.items()}


def run_pass(
    acc: Accumulator,
    segments: list[tuple[str, int, int]],
    truth: dict[str, dict[str, torch.Tensor]],
    prompt_lens: dict[str, int],
    mode: str = "EXTEND",
) -> list[Outcome]:
    pieces = plan_pass(
        mode,
        [s[0] for s in segments],
        [s[2] for s in segments],
        [s[1] for s in segments],
        {r: n for r, n in prompt_lens.items() if r in [s[0] for s in segments]},
        rid_prefix="hscap",
    )
    return acc.add_pass(pieces, pass_rows(segments, truth))


def schedule(lengths: dict[str, int], chunk: int) -> list[list[tuple[str, int, int]]]:
    """Passes as SGLang's FCFS chunked prefill forms them: the chunked request first, then new ones."""
    queue = list(lengths)
    done = dict.fromkeys(lengths, 0)
    passes = []
    while queue:
        budget, segments = chunk, []
        for r in list(queue):
            n = min(lengths[r] - done[r], budget)
            segments.append((r, done[r], n))
            done[r] += n
            budget -= n
            if done[r] == lengths[r]:
                queue.remove(r)
            if budget == 0:
                break
        passes.append(segments)
    return passes


def new_accumulator(max_idle_passes: int = 100) -> Accumulator:
    return Accumulator(alloc=lambda shape, dtype: torch.empty(shape, dtype=dtype), max_idle_passes=max_idle_passes)


def test_plan_pass_offsets_and_filters() -> None:
    rids = ["4687d4f7a1", rid("a"), "HEALTH_CHECK_1795938259.08", rid("b:c"), "other:job:x:0"]
    lengths = {rid("a"): 150, rid("b:c"): 90}
    pieces = plan_pass("EXTEND", rids, [3, 22, 1, 42, 5], [0, 128, 0, 0, 0], lengths, rid_prefix="hscap")
    assert pieces == [Piece(rid("a"), 3, 22, 128, 150), Piece(rid("b:c"), 26, 42, 0, 90)]


@pytest.mark.parametrize("mode", ["DECODE", "IDLE", "TARGET_VERIFY"])
def test_plan_pass_ignores_other_modes(mode: str) -> None:
    assert plan_pass(mode, [rid("a")], [1], [5], {rid("a"): 10}, rid_prefix="hscap") == []


def test_plan_pass_ignores_internal_passes() -> None:
    assert plan_pass("EXTEND", None, None, None, {}, rid_prefix="hscap") == []
    assert plan_pass("EXTEND", ["6c1f0e", "HEALTH_CHECK_1"], [3, 1], [0, 0], {}, rid_prefix="hscap") == []


def test_plan_pass_clips_rows_past_the_prompt() -> None:
    # MIXED: running decode requests join an extend pass with one row each, past their prompt.
    pieces = plan_pass("MIXED", [rid("a"), rid("b")], [1, 10], [20, 0], {rid("a"): 20, rid("b"): 8}, rid_prefix="hscap")
    assert pieces == [Piece(rid("b"), 1, 8, 0, 8)]


def test_plan_pass_needs_prompt_lengths_for_captured_rids() -> None:
    with pytest.raises(ValueError, match="no prompt length"):
        plan_pass("EXTEND", [rid("a"), "warmup"], [4, 3], [0, 0], {rid("b"): 4}, rid_prefix="hscap")
    with pytest.raises(ValueError, match="disagree"):
        plan_pass("EXTEND", [rid("a"), rid("b")], [4, 2], [0], {rid("a"): 4, rid("b"): 2}, rid_prefix="hscap")


def test_prompts_keep_only_captured_rids_and_stay_bounded() -> None:
    lengths = Prompts("hscap", capacity=3)
    lengths.record("4687d4f7a1", 3)
    lengths.record("HEALTH_CHECK_17", 1)
    lengths.record(None, 5)
    assert len(lengths) == 0
    for i in range(5):
        lengths.record(rid(str(i)), 10 + i)
    lengths.record(rid("2"), 12)  # recorded again by a later pass: now the newest
    assert dict(lengths) == {rid("4"): 14, rid("2"): 12} | {rid("3"): 13}
    assert list(lengths) == [rid("3"), rid("4"), rid("2")]
    lengths.forget(rid("3"))
    lengths.forget(rid("never"))
    assert list(lengths) == [rid("4"), rid("2")]
    lengths.record(rid("m"), 4, {"mask": [[1, 3]]})  # custom params the client sent along
    assert lengths.params(rid("m")) == {"mask": [[1, 3]]} and lengths.params(rid("2")) == {}
    lengths.record(rid("n"), 2)
    lengths.record(rid("o"), 2)  # evicts "4" and "2"; "m" is the oldest left
    lengths.record(rid("p"), 2)  # evicts "m" and its mask
    assert rid("m") not in lengths and lengths.params(rid("m")) == {}


def test_chunked_multi_request_passes_reassemble_exactly() -> None:
    lengths = {rid("c0"): 150, rid("c1"): 20, rid("c2"): 90, rid("c3"): 5, rid("c4"): 64, rid("c5"): 1}
    truth = make_truth(lengths)
    passes = schedule(lengths, chunk=64)
    assert any(len(p) > 1 for p in passes) and any(s[1] > 0 for p in passes for s in p)
    acc = new_accumulator()
    completed: dict[str, dict[str, torch.Tensor]] = {}
    for segments in passes:
        for outcome in run_pass(acc, segments, truth, lengths):
            assert isinstance(outcome, Completed), outcome
            completed[outcome.rid] = outcome.tensors
    assert set(completed) == set(lengths)
    for r, tensors in completed.items():
        for name, expected in truth[r].items():
            assert torch.equal(tensors[name], expected), (r, name)
    assert acc.in_progress == 0


def test_out_of_order_completion_and_foreign_rows() -> None:
    lengths = {rid("long"): 200, rid("short"): 10}
    truth = make_truth(lengths)
    acc = new_accumulator()
    # The long request starts first; warmup and health-check rows share the passes.
    assert run_pass(acc, [("4687d4f7", 0, 3), (rid("long"), 0, 61)], truth, lengths) == []
    outcomes = run_pass(acc, [(rid("long"), 61, 50), ("HEALTH_CHECK_9", 0, 1), (rid("short"), 0, 10)], truth, lengths)
    assert [o.rid for o in outcomes] == [rid("short")]
    run_pass(acc, [("4687d4f7", 3, 1)], truth, lengths, mode="DECODE")
    outcomes = run_pass(acc, [(rid("long"), 111, 89)], truth, lengths)
    assert [o.rid for o in outcomes] == [rid("long")]
    assert torch.equal(outcomes[0].tensors["aux"], truth[rid("long")]["aux"])


def test_prefix_cache_hit_is_reported_once_then_skipped() -> None:
    lengths = {rid("hit"): 100}
    truth = make_truth(lengths)
    acc = new_accumulator()
    outcomes = run_pass(acc, [(rid("hit"), 36, 28)], truth, lengths)
    assert len(outcomes) == 1 and isinstance(outcomes[0], Failed)
    assert "prefix-cache hit" in outcomes[0].reason and "36" in outcomes[0].reason
    assert run_pass(acc, [(rid("hit"), 64, 36)], truth, lengths) == []
    assert acc.in_progress == 0
    # The rid is forgotten once its prompt has gone by: a later full run of it is captured normally.
    outcomes = run_pass(acc, [(rid("hit"), 0, 64)], truth, lengths) + run_pass(
        acc, [(rid("hit"), 64, 36)], truth, lengths
    )
    assert [type(o) for o in outcomes] == [Completed]
    assert torch.equal(outcomes[0].tensors["final_post"], truth[rid("hit")]["final_post"])


def test_missing_pass_is_a_failure_not_a_silent_gap() -> None:
    lengths = {rid("gap"): 150}
    truth = make_truth(lengths)
    acc = new_accumulator()
    run_pass(acc, [(rid("gap"), 0, 64)], truth, lengths)
    outcomes = run_pass(acc, [(rid("gap"), 128, 22)], truth, lengths)
    assert len(outcomes) == 1 and isinstance(outcomes[0], Failed) and "out of sequence" in outcomes[0].reason
    assert acc.in_progress == 0


def test_abandoned_request_is_evicted() -> None:
    lengths = {rid("aborted"): 300, rid("other"): 1000}
    truth = make_truth(lengths)
    acc = new_accumulator(max_idle_passes=3)
    run_pass(acc, [(rid("aborted"), 0, 64)], truth, lengths)
    assert acc.in_progress == 1
    outcomes: list[Outcome] = []
    for position in range(0, 256, 64):
        outcomes += run_pass(acc, [(rid("other"), position, 64)], truth, lengths)
    assert [(o.rid, type(o)) for o in outcomes] == [(rid("aborted"), Failed)]
    assert "abandoned" in outcomes[0].reason
    assert acc.in_progress == 1  # only "other" remains


def test_rows_shorter_than_plan_is_an_error() -> None:
    acc = new_accumulator()
    pieces = [Piece(rid("a"), 0, 10, 0, 10)]
    with pytest.raises(ValueError, match="hold only"):
        acc.add_pass(pieces, {"aux": torch.zeros(6, K, H)})
