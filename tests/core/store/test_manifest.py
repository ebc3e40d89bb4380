"""A resume into a store regenerated under other rules (an older layertap's) is refused in one readable line."""

from __future__ import annotations

from pathlib import Path

import pytest

from layertap.errors import StoreError
from layertap.regenerate import RULES
from layertap.store.manifest import check_compatible
from tests.core.store.test_adopt import _store


def test_a_store_regenerated_under_other_rules_is_another_run_named_by_its_rules(tmp_path: Path) -> None:
    made = _store(tmp_path / "out", "specforge")
    made.close()
    settings = {"mode": "all", "max_new_tokens": 8, "temperature": 0.0}
    now = made.manifest.model_copy(update={"generation": {**settings, "rules": RULES}})
    older = {k: v for k, v in RULES.items() if k != "trained"}  # before the rule of trained turns
    check_compatible(now, now)
    with pytest.raises(StoreError) as err:
        check_compatible(made.manifest.model_copy(update={"generation": {**settings, "rules": older}}), now)
    said = str(err.value)
    assert said.startswith("output folder belongs to a different run; generation.rules: the store was regenerated "
                           "under other rules (trained: another layertap's")  # fmt: skip
    assert RULES["turns"] not in said  # named, not printed whole
    with pytest.raises(StoreError, match=r"generation.max_new_tokens: store has 4, this run has 8$"):
        check_compatible(now.model_copy(update={"generation": {**settings, "max_new_tokens": 4, "rules": RULES}}), now)
    with pytest.raises(StoreError, match=r"generation: store has None, this run has \{"):
        check_compatible(made.manifest, now)
