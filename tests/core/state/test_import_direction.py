"""Dependencies point one way: coordinator/ and worker/ import layertap/, never each other, and
layertap/ imports neither FastAPI nor Celery (so the state model can be used anywhere); benchmarks/ never imports
tests/, and harness/ (what tests and benchmarks both stand up) imports neither."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
FORBIDDEN = {
    "layertap": {"fastapi", "starlette", "celery", "kombu", "coordinator", "worker"},
    "coordinator": {"worker"},
    "worker": {"coordinator", "fastapi", "starlette"},
    "benchmarks": {"tests"},
    "harness": {"tests", "benchmarks"},
}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_point_one_way(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no Python files under {package}/"
    bad = {
        str(path.relative_to(ROOT)): sorted(found)
        for path in files
        if (found := imported_roots(path) & FORBIDDEN[package])
    }
    assert bad == {}
