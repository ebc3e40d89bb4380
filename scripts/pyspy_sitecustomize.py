"""py-spy attached to the processes a benchmark starts, for profiling on the device (docs/performance.md).

Copy this file to ``/tmp/site/sitecustomize.py`` (on ``PYTHONPATH`` there), put py-spy's manylinux wheel in the call's
bundle, and set ``LT_PROF`` to a folder: every ``layertap extract`` (named by its ``--out`` folder) and every stream
bench consumer (``consume``, named by its result file) then records two profiles in raw (collapsed) form while it runs:
``NAME-gil.txt`` (the thread holding the GIL) and ``NAME-busy.txt`` (each thread's non-idle samples, the thread first).
With ``LT_PROF_ONLY`` set, only the processes whose NAME holds it are recorded (stream_bench's ``-prof`` arms, the rest
of a call timed unprofiled). With ``LT_PROF_SERVER=1`` the SGLang server's processes are recorded too (``server-PID``:
its launcher and the processes it spawns, the scheduler whose threads write the dumps among them).
py-spy samples without pausing the process (``--nonblocking``), yet the process runs slower: time nothing with it.
"""

import os
import sys

_argv = getattr(sys, "orig_argv", sys.argv)
_out = os.environ.get("LT_PROF")
_extract, _consume = "layertap" in _argv and "extract" in _argv, "consume" in _argv
_server = os.environ.get("LT_PROF_SERVER") == "1" and any("sglang" in a or "spawn_main" in a for a in _argv)
if _out and (_extract or _consume or _server):
    import contextlib
    import ctypes
    import shutil
    import subprocess

    with contextlib.suppress(OSError, AttributeError):  # Yama's scope 1 lets only ancestors attach: allow any
        ctypes.CDLL(None).prctl(0x59616D61, ctypes.c_ulong(-1), 0, 0, 0)  # PR_SET_PTRACER, PR_SET_PTRACER_ANY
    if _consume:
        _name = os.path.basename(_argv[_argv.index("consume") + 4]).removesuffix(".json")  # consumer-ARM-ROUND-I
    elif _extract:
        _name = os.path.basename(_argv[_argv.index("--out") + 1]) if "--out" in _argv else str(os.getpid())
    else:
        _name = f"server-{os.getpid()}"
    _modes = (("gil", "--gil"), ("busy", "--threads")) if os.environ.get("LT_PROF_ONLY", "") in _name else ()
    for _mode, _flag in _modes:
        with open(f"{_out}/{_name}-{_mode}.log", "w") as _log:  # py-spy's own messages (a refused attach)
            subprocess.Popen(
                [shutil.which("py-spy") or "/tmp/site/bin/py-spy", "record", "--pid", str(os.getpid()), "--rate",
                 "200", "--nonblocking", "--format", "raw", "-o", f"{_out}/{_name}-{_mode}.txt", _flag],
                stdout=subprocess.DEVNULL, stderr=_log,
            )  # fmt: skip
