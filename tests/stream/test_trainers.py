"""One run's stream feeds a SpecForge and a speculators training step, each through its own CLI, trainer, model and
loss, in a trainer process of the trainers' venv that reads the stream itself (`StreamDataset`): its samples, not
files, are what each step trains on (`layertap.stream.trainers` shapes them as each trainer's own data pipeline
does; tests/trainers/run_specforge.py and run_speculators.py ``--stream`` say where they come in).
"""

from __future__ import annotations

import json
import math
import re
import shlex
import signal

import yaml

from harness.processes import LAYERTAP, REPO_ROOT, Proc, wait_for
from layertap.state.keys import Keys
from layertap.store.store import OutputStore
from tests.core.datasets import conversation_rows, write_jsonl
from tests.stream.test_stream import env, stream_args
from tests.trainers.test_interop import DRAFT_VOCAB, _block, _extract, _specforge_run, _specforge_steps, _train

ROWS = 2  # one for each trainer's step


def _said(what: str, output: str) -> list[dict]:
    """The JSON of each ``<what> {json}`` line a trainer process printed."""
    return [json.loads(line) for line in re.findall(rf"^{what} (.*)$", output, flags=re.M)]


def _stream_check(output: str) -> list[dict]:
    [check] = _said("stream-check", output)
    return check


def test_one_runs_stream_feeds_a_specforge_and_a_speculators_step(
    trainers_python, tiny_llama, mooncake_master, redis_server, redis_client, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))  # the trainer process imports layertap.stream
    # SpecForge's run.yaml (and the post-norm files to check against) from a specforge store of the same rows.
    specforge_out = _extract(tiny_llama, tmp_path, "specforge", ROWS)
    config, run_yaml = _specforge_run(specforge_out, tmp_path)
    config["training"]["num_epochs"] = 1
    run_yaml.write_text(yaml.safe_dump(config))

    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(ROWS, seed=21, max_words=25))
    out, name, keys = tmp_path / "streamed", "trainers-run", Keys()
    producer = Proc("extract", [*LAYERTAP, "extract", "--model", str(tiny_llama), "--data", str(data), "--layers",
                                "1,3,5", "--out", str(out), *stream_args(mooncake_master, redis_server, name)],
                    env(), tmp_path / "extract.log").start()  # fmt: skip
    stream = [redis_server.url, name, mooncake_master.address, "1"]
    try:
        specforge = _train(trainers_python, "run_specforge.py",
                           ["--stream", *stream, str(tiny_llama), "train", "--config", str(run_yaml)], tmp_path)  # fmt: skip
        guide = wait_for(lambda: (out / "TRAIN.md").exists() and (out / "TRAIN.md").read_text(), timeout=120,
                         what="the streamed run's TRAIN.md")  # fmt: skip
        command = shlex.split(_block(guide, "bash").replace("\\\n", " "))
        extra = ["--draft-vocab-size", str(DRAFT_VOCAB), "--epochs", "1", "--total-seq-len", "512", "--num-workers",
                 "0", "--save-path", str(tmp_path / "speculators-run"), "--draft-attn-impl", "sdpa",
                 "--loss-implementation", "eager"]  # fmt: skip
        speculators = _train(trainers_python, "run_speculators.py", ["--stream", *stream, *command[1:], *extra],
                             tmp_path)  # fmt: skip
        assert producer.popen.wait(timeout=120) == 0, producer.log_tail()
    finally:
        producer.kill(signal.SIGKILL)

    # SpecForge: one step, on the streamed sample, whose features are its file's (the final state normed here from
    # the stream's pre-norm one, within bfloat16's rounding of the file's, normed in float32 by the run).
    [step] = _specforge_steps(specforge)
    assert math.isfinite(step["loss"]), specforge[-3000:]
    [sample] = _stream_check(specforge)
    assert sample["equal"] == ["input_ids", "loss_mask", "aux_hidden_state"], sample
    assert sample["final_rel_diff"] <= 2**-7, sample
    # Its sample acked after the optimizer step that used it (SpecForge's ack_fn), pending until then; the step's
    # log line comes before the ack.
    [ack] = _said("stream-ack", specforge)
    assert ack["step"] == 1 and ack["pending"] == 1 and len(ack["samples"]) == 1, ack
    assert specforge.index("stream-ack ") > specforge.index("stream-check ")
    assert redis_client.hget(keys.stream_acked(name), ack["samples"][0]) is not None
    # speculators: one step, on the streamed sample, which is the item its own reader makes of the store's file.
    losses = [float(x) for x in re.findall(r"train/loss=([-+.\de]+)", speculators)]
    assert len(losses) == 1 and math.isfinite(losses[0]), speculators[-3000:]
    [item] = _stream_check(speculators)
    assert item["equal"] == item["keys"], item

    # Each sample of the run acked once, one by each trainer's process; none pending.
    acked = redis_client.hgetall(keys.stream_acked(name))
    assert sorted(acked) == sorted(OutputStore.open_existing(out).records()) and len(set(acked.values())) == ROWS
    assert redis_client.xpending(keys.stream(name), "trainers")["pending"] == 0
