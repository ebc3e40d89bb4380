"""Regenerating a conversation's responses with the target model itself (drafters learn the target's own text).

`turns.py`: which turns, the settings, turn seeds, generated ids -> an OpenAI assistant message, and the check
that the template gives back the ids the generation saw; `client.py`: the SGLang ``/generate`` requests.
"""

from layertap.regenerate.client import AHEAD_BATCHES, Regenerator, RowJob
from layertap.regenerate.turns import (
    RULES,
    GeneratedTurn,
    Regenerated,
    TurnFormat,
    retokenization_mismatches,
    stored_conversation,
    turn_seed,
    turns_to_regenerate,
)
from layertap.spec import GenerationSettings

__all__ = [
    "AHEAD_BATCHES",
    "RULES",
    "GeneratedTurn",
    "GenerationSettings",
    "Regenerated",
    "Regenerator",
    "RowJob",
    "TurnFormat",
    "retokenization_mismatches",
    "stored_conversation",
    "turn_seed",
    "turns_to_regenerate",
]
