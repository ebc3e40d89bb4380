"""What tests and benchmarks alike stand up: processes with their logs, Redis, the coordinator (uvicorn), Celery
workers, the CPU SGLang server's settings, the ``layertap`` command line, and free ports.

A top-level package beside ``benchmarks/`` and ``tests/``, not inside either, so that both import it and neither
imports the other (``benchmarks/`` never imports ``tests/``); and not inside the core ``layertap/``, which must not
know how its services are deployed (it starts none of FastAPI or Celery). The convention is a library's testing
helpers shipped as a package of their own (``celery.contrib.testing``, ``fastapi.testclient``): here the repository
is the library, so the package sits at its root and is not installed with the product (pyproject lists only
``layertap``, ``coordinator``, ``worker`` and ``sglang_patch``). It imports only ``free_port`` from the core, the
standard library, httpx and redis: what the device machine has. Nothing here imports pytest;
the fixtures in ``tests/service_fixtures.py`` are thin wrappers over it.

- ``harness.processes``: ``Proc`` (a subprocess in a session of its own, its output in a log file), waiting,
  the ``layertap`` command line.
- ``harness.services``: ``RedisServer``, ``Coordinator``, ``Services`` (coordinator and worker subprocesses).
- ``harness.sglang``: the CPU SGLang server's interpreter, flags, environment and libcuda stub.
"""
