"""Starting a capture server: a failed start is retried with backoff, unless it would fail the same way again
(a hang, a watchdog timeout, an import error, a refused command line); when it is not started, the error says in two
lines how the last try ended, the decisive line of its log and where the log is.

The failing server is a real process: a stand-in for the server's python (``FakeServerPython``) that
writes what a dying SGLang writes and exits; after it, the real CPU SGLang server (marked ``sglang``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import sglang_patch
from harness.processes import wait_for
from harness.sglang import CPU_SERVER_ARGS, cpu_server_env
from layertap.engines.sglang import process
from layertap.engines.sglang.launch import ServerConfig
from layertap.engines.sglang.process import PluginFolder, SGLangServer, live_group_members
from layertap.errors import ServerError
from layertap.models.folder import ModelFolder
from tests.core.datasets import conversation_rows, write_jsonl
from tests.sglang_fixtures import DEFAULT_LAYERS, SGLANG_PYTHON

# What SGLang 0.5.10 printed when its warm-up could not reach /model_info on a cold H200, shortened.
DYING_LOG = """\
[2026-11-30 10:00:01] server_args=ServerArgs(model_path='/models/kimi', tp_size=8, ...)
[2026-11-30 10:00:40] Load weight end. type=DeepseekV3ForCausalLM, avail mem=21.05 GB
Traceback (most recent call last):
  File "/opt/sglang-venv/lib/python3.11/site-packages/sglang/srt/entrypoints/http_server.py", line 1190, in _wait_and_warmup
    res = requests.get(url + "/model_info", timeout=5, headers=headers)
requests.exceptions.ReadTimeout: HTTPConnectionPool(host='127.0.0.1', port=30000): Read timed out. (read timeout=5)
[2026-11-30 10:02:11] Received sigquit from a child process. It usually means the child failed.
"""


# What SGLang 0.5.14 printed when a fresh H200's first forward pass (kernel builds) outran its scheduler watchdog,
# shortened: the py-spy line after it is how SGLang reported, not why the server died.
WATCHDOG_LOG = """\
[2026-12-01 08:10:02] Using CompressedTensorsWNA16MarlinMoEMethod
[2026-12-01 08:15:09] Scheduler watchdog timeout (self.watchdog_timeout=300, self.soft=False)
[2026-12-01 08:15:09] Pyspy failed (py-spy dump --pid 4242). Error: /bin/sh: 1: py-spy: not found
[2026-12-01 08:15:10] Received sigquit from a child process. It usually means the child failed.
"""


def test_the_servers_plugin_folder_holds_the_installed_plugin_alone_and_is_made_again_when_removed():
    plugin = PluginFolder()
    for _ in range(2):  # the second time after a temp cleaner removed it
        folder = plugin.path
        assert [p.name for p in folder.iterdir()] == ["sglang_patch"]
        assert (folder / "sglang_patch").resolve() == Path(sglang_patch.__file__).resolve().parent
        shutil.rmtree(folder)


def fake_server_python(folder: Path, *, fail_times: int, how: str = "exit 3", log: str = DYING_LOG) -> Path:
    """An executable standing in for the server's python: its first ``fail_times`` runs print ``log``
    and end with ``how`` (``exit 3``, ``kill -9 $$``); later runs exec the real SGLang python."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "python"
    log_text = log.replace("'", "'\\''")
    script.write_text(
        "#!/bin/bash\n"
        f'runs="{folder}/runs"; n=$(cat "$runs" 2>/dev/null || echo 0); echo $((n + 1)) > "$runs"\n'
        f"if [ \"$n\" -lt {fail_times} ]; then printf '%s' '{log_text}'; {how}; fi\n"
        f'exec {SGLANG_PYTHON} "$@"\n'
    )
    script.chmod(0o755)
    return script


def _config(python: Path, model: Path, tmp_path: Path, **kw) -> ServerConfig:
    return ServerConfig(python=python, model=model, dump_root=tmp_path / "dumps", layers=DEFAULT_LAYERS["llama"],
                        final="post", log_path=tmp_path / "server.log", **kw)  # fmt: skip


def test_when_every_start_fails_the_error_is_two_lines_naming_the_exit_the_log_line_and_the_log(tiny_llama, tmp_path):
    fake = fake_server_python(tmp_path / "fake", fail_times=99)
    server = SGLangServer(_config(fake, tiny_llama, tmp_path, start_attempts=3, start_backoff_s=0.05))
    with pytest.raises(ServerError) as info:
        server.start()
    message = str(info.value)
    assert message == (
        'SGLang server failed to start (3 tries); the last exited with code 3: "requests.exceptions.ReadTimeout: '
        "HTTPConnectionPool(host='127.0.0.1', port=30000): Read timed out. (read timeout=5)\"\n"
        f"server log: {tmp_path / 'server.log'}"
    )
    assert (tmp_path / "fake" / "runs").read_text().strip() == "3"
    log = (tmp_path / "server.log").read_text()
    assert re.findall(r"--- layertap: (start attempt \d/3) on port \d+ ---", log) == [
        f"start attempt {n}/3" for n in (1, 2, 3)
    ]


def test_a_server_killed_by_a_signal_is_described_so(tiny_llama, tmp_path):
    fake = fake_server_python(tmp_path / "fake", fail_times=99, how="kill -9 $$")
    server = SGLangServer(_config(fake, tiny_llama, tmp_path, start_attempts=1))
    with pytest.raises(ServerError, match=r"\(1 tries\); the last exited on signal 9 \(SIGKILL\): .*ReadTimeout"):
        server.start()


def test_a_watchdog_timeout_is_named_as_the_cause_and_not_retried(tiny_llama, tmp_path):
    fake = fake_server_python(tmp_path / "fake", fail_times=99, how="kill -9 $$", log=WATCHDOG_LOG)
    server = SGLangServer(_config(fake, tiny_llama, tmp_path, start_attempts=3, start_backoff_s=0.05))
    with pytest.raises(ServerError) as info:
        server.start()
    first = str(info.value).splitlines()[0]
    assert "not retried" in first and "--watchdog-timeout" in first and "exited on signal 9" in first
    assert first.endswith(
        "'[2026-12-01 08:15:09] Scheduler watchdog timeout (self.watchdog_timeout=300, self.soft=False)'"
    )
    assert "py-spy" not in first.lower().replace("--watchdog", "")
    assert (tmp_path / "fake" / "runs").read_text().strip() == "1"


def test_a_start_that_never_becomes_healthy_is_not_retried(tiny_llama, tmp_path):
    fake = fake_server_python(tmp_path / "fake", fail_times=99, how="sleep 60")
    server = SGLangServer(_config(fake, tiny_llama, tmp_path, start_attempts=3, start_backoff_s=0.05,
                                  startup_timeout_s=2.0))  # fmt: skip
    with pytest.raises(
        ServerError, match=r"failed to start \(try 1, not retried: a start that hung .*\); it was not healthy after 2 s"
    ):
        server.start()
    assert (tmp_path / "fake" / "runs").read_text().strip() == "1"


def test_cli_prints_the_short_error_and_exits_2_without_a_traceback(layertap_cli, tiny_llama, tmp_path):
    fake = fake_server_python(tmp_path / "fake", fail_times=99)
    data = write_jsonl(tmp_path / "chats.jsonl", conversation_rows(3))
    cli = layertap_cli("extract", "--model", tiny_llama, "--data", data, "--layers", "1,2,3", "--out", tmp_path / "out",
                       "--engine", "sglang", "--sglang-python", fake, "--dump-root", tmp_path / "dumps", timeout=300,
                       env={**os.environ, "COLUMNS": "400"})  # fmt: skip
    assert cli.returncode == 2, cli.stderr[-3000:]
    assert "Traceback" not in cli.stderr and 'File "' not in cli.stderr
    *retries, error, log = [line for line in cli.stderr.splitlines() if line.strip()]
    assert [r.split(" failed")[0] for r in retries] == [
        f"{stamp} WARNING layertap.engines.sglang.process: SGLang server start {n}/3"
        for stamp, n in zip([r[:23] for r in retries], (1, 2), strict=True)
    ]  # the log's one format: time, level, logger, message
    assert error.startswith("error: SGLang server failed to start (3 tries); the last exited with code 3: ")
    assert error.endswith('Read timed out. (read timeout=5)"')
    assert log == f"server log: {tmp_path / 'sglang-server.log'}"


@pytest.mark.sglang
def test_a_start_that_fails_once_is_retried_and_the_server_then_serves(
    tiny_llama, cuda_stub_dir, tmp_path, sglang_python
):
    fake = fake_server_python(tmp_path / "fake", fail_times=1, how="kill -9 $$")
    config = _config(fake, tiny_llama, tmp_path, env=cpu_server_env(cuda_stub_dir), start_backoff_s=0.5,
                     sglang_args=(*CPU_SERVER_ARGS, "--dtype", "float32"))  # fmt: skip
    server = SGLangServer(config)
    try:
        server.start()
        assert server.alive()
    finally:
        server.stop()
    assert (tmp_path / "fake" / "runs").read_text().strip() == "2"
    log = (tmp_path / "server.log").read_text()
    first, second = log.split("--- layertap: start attempt 2/3")
    assert "start attempt 1/3" in first and "Read timed out" in first and "Read timed out" not in second


# A forward hook whose factory's module is nowhere: SGLang's scheduler fails to import it as it loads the model.
MISSING_HOOK = [{"name": "missing", "target_modules": ["model.layers.0"], "hook_factory": "no_such_hook_module:factory",
                 "config": {}}]  # fmt: skip


@pytest.mark.sglang
@pytest.mark.parametrize(
    ("flags", "says", "reason"),
    [
        (("--forward-hooks", json.dumps(MISSING_HOOK)), "ModuleNotFoundError: No module named 'no_such_hook_module'",
         "a module did not import"),
        (("--no-such-flag",), "error: unrecognized arguments: --no-such-flag", "its command line was refused"),
        (("--pp-size", "2"), "pipeline parallelism (--pp-size > 1) is not supported", "its command line was refused"),
    ],
    ids=["import-error", "rejected-flag", "refused-setting"],
)  # fmt: skip
def test_a_start_that_would_fail_again_is_reported_once_with_the_servers_own_line_and_not_retried(
    flags, says, reason, tiny_llama, cuda_stub_dir, tmp_path, caplog, sglang_python
):
    config = _config(sglang_python, tiny_llama, tmp_path, env=cpu_server_env(cuda_stub_dir), start_backoff_s=0.05,
                     sglang_args=(*CPU_SERVER_ARGS, "--dtype", "float32", *flags))  # fmt: skip
    with caplog.at_level(logging.WARNING), pytest.raises(ServerError) as info:
        SGLangServer(config).start()
    first, log_line = str(info.value).splitlines()
    assert first.startswith(f"SGLang server failed to start (try 1, not retried: {reason}") and says in first, first
    assert log_line == f"server log: {config.log_path}"
    assert config.log_path.read_text().count("--- layertap: start attempt") == 1
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]


# A forward hook that raises on the first captured request (rid prefix "hscap:"), not on SGLang's warm-up:
# a server that dies at its first request, of a cause the test controls (as a tokenizer's KeyError did).
CRASH_HOOK = """
def factory(config):
    def hook(module, inputs, output):
        if any(str(rid).startswith("hscap:") for rid in getattr(inputs[2], "rids", None) or []):
            raise KeyError(3720)
    return hook
"""


@pytest.mark.sglang
def test_a_server_dying_at_its_first_request_is_restarted_once_then_named_attached_ones_are_not(
    tiny_llama, cuda_stub_dir, tmp_path, monkeypatch, caplog, sglang_python
):
    import torch

    from layertap.engines.sglang import SGLangEngine
    from layertap.sample import TokenizedSample
    from layertap.spec import resolve_capture

    (tmp_path / "hooks").mkdir()
    (tmp_path / "hooks" / "crash_hook.py").write_text(CRASH_HOOK)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "hooks"))
    hooks = [
        {"name": "crash", "target_modules": ["model.layers.0"], "hook_factory": "crash_hook:factory", "config": {}}
    ]
    config = _config(sglang_python, tiny_llama, tmp_path, env=cpu_server_env(cuda_stub_dir), start_backoff_s=0.5,
                     sglang_args=(*CPU_SERVER_ARGS, "--dtype", "float32", "--forward-hooks", json.dumps(hooks)))  # fmt: skip
    capture = resolve_capture(list(DEFAULT_LAYERS["llama"]), convention="capture", num_layers=6, final="post")
    sample = TokenizedSample("s0", 0, torch.arange(4, 40), torch.ones(36, dtype=torch.uint8))
    owned = SGLangServer(config)
    owned.start()
    try:
        # Both engines check the server before any sample (each is refused unless it serves tiny_llama).
        folder = ModelFolder.read(tiny_llama)
        attached = SGLangEngine(SGLangServer(url=owned.url), capture, folder=folder, dump_root=config.dump_root,
                                job="t", in_flight=4)  # fmt: skip
        engine = SGLangEngine(owned, capture, folder=folder, dump_root=config.dump_root, job="t", in_flight=4,
                              max_server_restarts=1)  # fmt: skip
        # Attached by URL: the server dies and the one message says it is not restarted (nothing says it is).
        with caplog.at_level(logging.INFO), pytest.raises(ServerError) as info:
            list(attached.capture([sample]))
        assert f"the SGLang server at {owned.url} is down" in str(info.value)
        assert "layertap does not restart it" in str(info.value)
        assert "restart" not in caplog.text.lower()
        # Owned (and dead by now): restarted once, dies again, and the error names the exception and the log.
        caplog.clear()
        with caplog.at_level(logging.WARNING), pytest.raises(ServerError) as info:
            list(engine.capture([sample]))
    finally:
        owned.stop()
    assert owned.restarts == 1
    first, log_line = str(info.value).splitlines()
    assert first.startswith("SGLang server exited ") and first.endswith(
        ", down again after 1 restart: 'KeyError: 3720'"
    )
    assert log_line == f"server log: {config.log_path}"
    warned = [r.getMessage() for r in caplog.records if "restarting it" in r.getMessage()]
    assert len(warned) == 1 and "'KeyError: 3720'" in warned[0]
    log = config.log_path.read_text()
    assert "py-spy" not in log.lower() and log.count("--- layertap: start attempt 1/3") == 2


def test_a_launched_process_outlives_the_thread_that_launched_it_and_dies_with_its_process(tmp_path):
    """PR_SET_PDEATHSIG follows the forking thread: a server restarted from a pool's thread was SIGKILLed when the pool
    shut down. Launched from a thread that then ends, the child lives on; its process SIGKILLed, the child goes too."""
    script = (
        "import sys, threading\n"
        "from layertap.engines.sglang.process import _launcher\n"
        "box = []\n"
        "thread = threading.Thread(target=lambda: box.append(_launcher.popen(['sleep', '600'])))\n"
        "thread.start(); thread.join()\n"
        "print(box[0].pid, flush=True); sys.stdin.readline()\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        time.sleep(0.5)  # the launching thread has ended; a signal for it would have come by now
        assert live_group_members(child) == [child]
    finally:
        parent.kill()
        parent.wait()
    wait_for(lambda: live_group_members(child) == [], timeout=10, what="the launched process to die with its parent")


@pytest.mark.sglang
def test_stop_returns_once_no_process_of_the_server_is_left(tiny_llama, cuda_stub_dir, tmp_path, monkeypatch):
    """SGLang's scheduler outlives its launcher for a moment, holding what the next server of the GPU needs: stop()
    returns once every process of the server's group is gone, SIGKILLing one that ignores SIGTERM. The server is
    started from a thread that ends before it is stopped (as a restart from a capture pool's thread is)."""
    monkeypatch.setattr(process, "STOP_GRACE_S", 3.0)
    python = tmp_path / "python"  # the real server, and beside it a process of its group that ignores SIGTERM
    python.write_text(f"#!/bin/bash\n( trap '' TERM; exec sleep 600 ) &\necho $! > {tmp_path}/stubborn\n"
                      f'exec {SGLANG_PYTHON} "$@"\n')  # fmt: skip
    python.chmod(0o755)
    config = _config(python, tiny_llama, tmp_path, env=cpu_server_env(cuda_stub_dir),
                     sglang_args=(*CPU_SERVER_ARGS, "--dtype", "float32"))  # fmt: skip
    server = SGLangServer(config)
    starter = threading.Thread(target=server.start)
    starter.start()
    starter.join()
    time.sleep(0.5)  # a signal for the ended thread would have come by now
    assert server.alive()
    group = os.getpgid(int((tmp_path / "stubborn").read_text()))
    try:
        members = live_group_members(group)
        assert len(members) >= 3, members  # the launcher, SGLang's scheduler (and detokenizer), the stubborn one
    finally:
        server.stop()
    assert live_group_members(group) == []
    server.stop()  # again: nothing left to signal, returns at once
