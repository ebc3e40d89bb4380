"""Error answers the API can always send: whatever a request held, the reply is valid JSON with a readable message,
in the one shape the OpenAPI document gives every error (``ErrorBody``, listed per route by ``responses``).

Starlette's JSONResponse refuses NaN and cannot encode a lone surrogate, and FastAPI's 422 echoes each
offending input; so a body with ``NaN`` or ``"\\ud800"`` in a wrong place would turn its own 422 into a 500.
"""

from __future__ import annotations

import json
import reprlib
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel

_INPUT = reprlib.Repr()
_INPUT.maxstring = _INPUT.maxother = 120


class Problem(BaseModel):
    """One way a request does not match its schema: pydantic's type and message, where, and the input's short repr."""

    type: str
    loc: list[str]
    msg: str
    input: str


class ErrorBody(BaseModel):
    """Every error answer: a message, or one ``Problem`` per mismatch when the request does not match its schema."""

    detail: str | list[Problem]


# What each status means in this API; ``responses`` lists the ones a route can answer.
_MEANING = {
    400: "The body cannot be parsed (not JSON).",
    401: "No bearer token, or not the coordinator's (LAYERTAP_API_TOKEN).",
    403: "Refused by the operator's policy: remote code not enabled, or a model or dataset outside its roots.",
    404: "No such job.",
    409: "In a state that forbids it: the job is done, or the output folder belongs to another job or run.",
    422: "The request, the spec or the dataset is invalid; ``detail`` says what to fix.",
    503: "Redis is unreachable: try again.",
    507: "The job's estimated output does not fit on the output volume above the free-space floor.",
}


def responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` of these error statuses, each an ``ErrorBody``."""
    return {code: {"model": ErrorBody, "description": _MEANING[code]} for code in codes}


class SafeJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped (a lone surrogate becomes ``\\ud800``, not an encoding error)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def error_handler(code: int) -> Callable[[Request, Exception], Awaitable[SafeJSONResponse]]:
    """``{"detail": str(exc)}`` with status ``code``: for the errors named by who acts (SpecError: 422...)."""

    async def handler(_: Request, exc: Exception) -> SafeJSONResponse:
        return SafeJSONResponse(status_code=code, content={"detail": str(exc)})

    return handler


async def invalid_request(_: Request, exc: RequestValidationError) -> SafeJSONResponse:
    """422 with pydantic's message and location per problem; the offending input as a short repr
    (JSON cannot carry NaN, and a body may be large)."""
    detail = [
        {
            "type": e["type"],
            "loc": [str(part) for part in e["loc"]],
            "msg": e["msg"],
            "input": _INPUT.repr(e.get("input")),
        }
        for e in exc.errors()
    ]
    return SafeJSONResponse(status_code=422, content={"detail": detail})
