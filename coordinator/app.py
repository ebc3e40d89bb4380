"""``uvicorn coordinator.app:app`` entry point (``layertap coordinator`` too): the settings are checked first, so
that a coordinator that cannot run as configured (no token and not told to be open...) says why in one line."""

from coordinator.config import require_settings

require_settings()

from coordinator.main import app  # noqa: E402 - only once the settings hold

__all__ = ["app"]
