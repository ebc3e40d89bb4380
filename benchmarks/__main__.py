"""``python -m benchmarks NAME [--smoke] [OPTIONS]``: run one benchmark, from the repository root.

A benchmark is a module ``benchmarks/NAME_bench.py`` (on the CPU) or ``benchmarks/gpu/NAME_bench.py`` (on the
device, through ``benchmarks/gpu/on_device.sh``) with a ``main(argv)``; its options are its own
(``python -m benchmarks NAME --help``), ``--smoke`` runs it small on this machine (the GPU ones on the CPU SGLang
server). Each writes one result (``benchmarks.report``): a JSON and the table rendered from it. Adding a benchmark is
adding such a module; this runner finds it by its file name.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def benchmarks() -> dict[str, Path]:
    """Every benchmark: NAME -> its module's file."""
    return {path.stem.removesuffix("_bench"): path for path in sorted(HERE.rglob("*_bench.py"))}


def summary(path: Path) -> str:
    """The first line of a module's docstring, read without importing it (the GPU ones import torch and SGLang's
    clients)."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.partition("\n")[0]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    known = benchmarks()
    if not argv or argv[0] not in known:
        names = "\n".join(f"  {name:<17} {summary(path)}" for name, path in known.items())
        sys.exit(f"usage: python -m benchmarks NAME [--smoke] [OPTIONS]  (NAME --help: its options)\n\n{names}")
    module = ".".join(known[argv[0]].relative_to(HERE.parent).with_suffix("").parts)
    importlib.import_module(module).main(argv[1:])


if __name__ == "__main__":
    main()
