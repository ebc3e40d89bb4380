"""The plugin runs in SGLang's own environment: it may import only torch, sglang, safetensors and the
standard library, and the modules the core package and the launcher need before SGLang is imported
(contract, settings, launch) only the standard library at module level.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "sglang_patch"
ALLOWED = {"torch", "sglang", "safetensors", "sglang_patch"}
STDLIB_AT_IMPORT = {"contract.py", "settings.py", "launch.py", "__init__.py"}


def imports(tree: ast.AST, *, top_level_only: bool) -> set[str]:
    nodes = tree.body if top_level_only else ast.walk(tree)  # type: ignore[attr-defined]
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*.py")), ids=lambda p: p.name)
def test_plugin_imports(path: Path) -> None:
    tree = ast.parse(path.read_text())
    foreign = {m for m in imports(tree, top_level_only=False) if m not in sys.stdlib_module_names} - ALLOWED
    assert not foreign, f"{path.name} imports {foreign}"
    if path.name in STDLIB_AT_IMPORT:
        at_import = {m for m in imports(tree, top_level_only=True) if m not in sys.stdlib_module_names}
        assert at_import <= {"sglang_patch"}, f"{path.name} imports {at_import} at module level"
