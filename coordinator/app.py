"""``uvicorn coordinator.app:app`` entry point."""

from coordinator.main import app

__all__ = ["app"]
