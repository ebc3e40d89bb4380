"""`layertap extract --engine sglang` as a user runs it: layertap installed from a wheel (not editable) in a fresh
venv, started from a folder of the user's. Its server must find the capture plugin through the installed package
(`layertap.engines.sglang.process.PluginFolder`), not through a working directory that happens to be this repository.

The fresh venv takes layertap and its plugin from the wheel and the dependencies (torch, transformers, ...) from the
venv running the tests, through a ``.pth`` line: that path's own ``.pth`` files are not read, so this checkout's
editable install stays invisible there, and the test first shows that the installed python cannot see the checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from harness.sglang import CPU_SERVER_ARGS, cpu_server_env
from layertap.store.store import OutputStore
from tests.core.datasets import conversation_rows, write_jsonl
from tests.sglang_fixtures import CHUNKED_PREFILL_SIZE, REPO_ROOT

pytestmark = pytest.mark.sglang

WHERE = (
    "import json, sys, layertap, sglang_patch; print(json.dumps([layertap.__file__, sglang_patch.__file__, sys.path]))"
)


def user_env() -> dict[str, str]:
    """This process's environment without anything that would point a python at this checkout or this venv."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``bin`` folder of a fresh venv with layertap installed from a wheel of this checkout's files."""
    root = tmp_path_factory.mktemp("installed")
    # A copy of the checkout, so that the build's own folders (build/, *.egg-info) land there, not here.
    source = shutil.copytree(REPO_ROOT, root / "source",
                             ignore=shutil.ignore_patterns(".*", "__pycache__", "*.egg-info", "build", "out", "runs"))  # fmt: skip
    run = {"check": True, "capture_output": True, "text": True, "timeout": 600, "env": user_env()}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(root / "dist"), str(source)], **run)  # fmt: skip
    (wheel,) = (root / "dist").glob("layertap-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], **run)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                    "--no-index", str(wheel)], **run)  # fmt: skip
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], **run)
    deps = dict.fromkeys((sysconfig.get_path("purelib"), sysconfig.get_path("platlib")))
    (Path(site.stdout.strip()) / "layertap-test-deps.pth").write_text("\n".join(deps) + "\n")
    return venv / "bin"


def test_extract_from_a_users_folder_with_a_non_editable_install_stores_verified_samples(
    installed, tiny_llama, cuda_stub_dir, tmp_path, sglang_python
):
    home = tmp_path / "user"
    home.mkdir()
    run = {"cwd": home, "capture_output": True, "text": True, "env": user_env()}
    # The installed layertap and its plugin are the wheel's, and no other folder on the path holds either.
    where = subprocess.run([str(installed / "python"), "-c", WHERE], check=True, timeout=120, **run)
    layertap_file, plugin_file, path = json.loads(where.stdout)
    venv = installed.parent.resolve()
    assert Path(layertap_file).resolve().is_relative_to(venv) and Path(plugin_file).resolve().is_relative_to(venv)
    holders = [p for p in path if (home / p / "layertap").exists() or (home / p / "sglang_patch").exists()]
    assert len(holders) == 1 and Path(holders[0]).resolve().is_relative_to(venv), path

    rows = conversation_rows(6, seed=3)
    write_jsonl(home / "chats.jsonl", rows)
    sglang_args = " ".join(
        (*CPU_SERVER_ARGS, "--dtype", "float32", "--chunked-prefill-size", str(CHUNKED_PREFILL_SIZE))
    )
    extract = subprocess.run(
        [str(installed / "layertap"), "extract", "--model", str(tiny_llama), "--data", "chats.jsonl",
         "--layers", "1,3,5", "--out", "states", "--engine", "sglang", "--sglang-python", str(sglang_python),
         "--sglang-args", sglang_args],
        timeout=900, **{**run, "env": {**run["env"], **cpu_server_env(cuda_stub_dir)}},
    )  # fmt: skip
    assert extract.returncode == 0, extract.stderr[-4000:]
    verify = subprocess.run([str(installed / "layertap"), "verify", "states"], timeout=600, **run)
    assert verify.returncode == 0, verify.stdout[-2000:] + verify.stderr[-2000:]
    store = OutputStore.open_existing(home / "states")
    assert store.manifest.engine["name"] == "sglang" and len(store.records()) == len(rows)
