"""The status page: plain HTML and JS (no build step) that polls ``/jobs`` and ``/workers``."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, HTTPException, status
from fastapi.responses import FileResponse, RedirectResponse

STATIC = Path(__file__).resolve().parents[2] / "static"
ASSETS = {"status.js": "text/javascript", "status.css": "text/css"}

router = APIRouter(tags=["status page"], include_in_schema=False)


@router.get("/")
def root() -> RedirectResponse:
    return RedirectResponse("/status")


@router.get("/status")
def page() -> FileResponse:
    """The page itself holds no data; its script calls the API (with the token, if one is set)."""
    return FileResponse(STATIC / "status.html", media_type="text/html")


@router.get("/status/{name}")
def asset(name: str) -> FileResponse:
    if name not in ASSETS:
        raise HTTPException(status.HTTP_404_NOT_FOUND)
    return FileResponse(STATIC / name, media_type=ASSETS[name])
