"""layertap: hidden-state extraction for speculative-decoding drafter training."""

__version__ = "0.1.0"
