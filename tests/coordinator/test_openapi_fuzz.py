"""The coordinator against its own OpenAPI document, over HTTP: a real uvicorn coordinator with a token, over the
session's real Redis, one job already submitted (so listings and lookups have something to show), no workers.

Schemathesis generates valid and invalid requests for every operation the document lists; each answer must be no
server error, with a status code, content type, headers and body the document gives that operation, and must not
be served without the token (its ``ignored_auth`` check repeats a call without it). Separately, every operation but
the two public by design answers 401 to a call without the token or with a wrong one.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.core.datasets import conversation_rows, write_jsonl

TOKEN = "fuzz-s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# Public by design: liveness for load balancers and compose's healthcheck, and Prometheus's scrape (job ids and
# counts, no paths or data). The status page's files are public too but are not API operations (not in the document).
PUBLIC = {("GET", "/health"), ("GET", "/metrics")}


@pytest.fixture
def coordinator_url(services, redis_server, redis_client, tiny_llama, tmp_path: Path) -> str:
    root = tmp_path / "outputs"
    root.mkdir()
    coordinator = services.coordinator(redis_server.url, root, token=TOKEN)
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(12, seed=3))
    job = {"model": str(tiny_llama), "data": str(data), "layers": [1, 3, 5], "shard_size": 4}
    with coordinator.client() as client:
        assert client.post("/jobs", json=job).status_code == 201
    return coordinator.url


# 200 examples per mode (valid, invalid) over all operations: ~400 requests, about a minute here with the server start.
# (Driven through hypothesis: schemathesis's pytest loader does not run under pytest 9.2.)
@pytest.mark.parametrize("mode", list(GenerationMode))
def test_every_answer_is_what_the_openapi_document_says(coordinator_url: str, mode: GenerationMode) -> None:
    api = schemathesis.openapi.from_url(f"{coordinator_url}/openapi.json")
    api.config.update(headers=AUTH)  # every call carries the token; ignored_auth repeats it without

    seen: set[int] = set()

    @given(case=api.as_strategy(generation_mode=mode))
    @settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def call(case: schemathesis.Case) -> None:
        # A schema-valid spec may still be refused (422): a model folder that does not exist, layers beyond the
        # model's depth: what the schema cannot say. Every other check runs, negative_data_rejection included.
        seen.add(case.call_and_validate(excluded_checks=[positive_data_acceptance]).status_code)

    call()
    assert {200, 422} <= seen, seen  # the calls got past the token (it is checked before the request is)


def operations(document: dict) -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, item in document["paths"].items() for method in item}


def test_no_operation_but_the_public_ones_is_served_without_the_token(coordinator_url: str) -> None:
    document = httpx.get(f"{coordinator_url}/openapi.json", timeout=30).json()
    listed = operations(document)
    assert listed > PUBLIC  # the public ones, and more
    for method, path in sorted(listed - PUBLIC):
        url = coordinator_url + path.replace("{job_id}", "anything")
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):  # none, wrong, not bearer
            reply = httpx.request(method, url, headers=headers, json={}, timeout=30)
            assert reply.status_code == 401, (method, path, headers, reply.text)
            assert reply.json() == {"detail": "missing or wrong bearer token"}
        # The document says so: the operation names the bearer scheme and lists the 401.
        operation = document["paths"][path][method.lower()]
        assert operation["security"] and "401" in operation["responses"], (method, path)
    for method, path in PUBLIC:
        assert httpx.request(method, coordinator_url + path, timeout=30).status_code == 200, path
