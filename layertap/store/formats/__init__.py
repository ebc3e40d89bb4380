"""One module per trainer format behind the ``SampleFormat`` interface."""

from layertap.store.formats.base import SampleFormat
from layertap.store.formats.specforge import SpecForgeFormat
from layertap.store.formats.speculators import SpeculatorsFormat

FORMATS: dict[str, type[SampleFormat]] = {"specforge": SpecForgeFormat, "speculators": SpeculatorsFormat}


def get_format(name: str) -> SampleFormat:
    """The format writer for a format name of the spec."""
    return FORMATS[name]()


__all__ = ["FORMATS", "SampleFormat", "get_format"]
