"""The coordinator app in-process (``TestClient``) over the session's real Redis; no workers run, so
messages it sends stay in the broker queue where the tests can count them."""

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from coordinator.main import app
from tests.core.datasets import conversation_rows, write_jsonl


@pytest.fixture
def make_api(redis_server, redis_client, tmp_path, monkeypatch) -> Iterator[Callable[..., TestClient]]:
    """``make_api(token=None, allow_remote_code=False, **roots)`` -> a started TestClient; outputs go under
    ``tmp_path / "outputs"``. Without a token the API is explicitly open (LAYERTAP_API_OPEN); ``roots``
    (``model_root``, ``data_root``) bound the paths a job may name."""
    clients: list[TestClient] = []

    def make(token: str | None = None, allow_remote_code: bool = False, **roots: Path) -> TestClient:
        monkeypatch.setenv("LAYERTAP_REDIS_URL", redis_server.url)
        monkeypatch.setenv("LAYERTAP_OUTPUT_ROOT", str(tmp_path / "outputs"))
        monkeypatch.setenv("LAYERTAP_REAPER_INTERVAL_S", "3600")
        monkeypatch.setenv("LAYERTAP_API_TOKEN", token or "")
        monkeypatch.setenv("LAYERTAP_API_OPEN", "false" if token else "true")
        monkeypatch.setenv("LAYERTAP_ALLOW_REMOTE_CODE", "1" if allow_remote_code else "0")
        for name in ("model_root", "data_root"):
            if name in roots:
                monkeypatch.setenv(f"LAYERTAP_{name.upper()}", str(roots[name]))
            else:
                monkeypatch.delenv(f"LAYERTAP_{name.upper()}", raising=False)
        client = TestClient(app)
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture
def api(make_api) -> TestClient:
    return make_api()


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    """45 conversations: 5 shards of 10 rows at shard_size 10."""
    return write_jsonl(tmp_path / "data.jsonl", conversation_rows(45, seed=1))
