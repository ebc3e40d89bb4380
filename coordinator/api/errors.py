"""Error answers the API can always send: whatever a request held, the reply is valid JSON with a readable message.

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

_INPUT = reprlib.Repr()
_INPUT.maxstring = _INPUT.maxother = 120


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
