"""Print the ten longest modules and the ten longest functions of the packages (``make lint``).

The house rule (docs/architecture.md, *Module size*): modules of one job, mostly 100-500 lines,
split before ~800; functions under ~80 lines except declarative tables (typer option lists).
This prints where the code stands against it; it does not fail the build.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGES = ("marduk", "agent", "monitor_cli")
TOP = 10


def functions(path: Path) -> list[tuple[int, str]]:
    """Each function's body in lines, from its first statement (a docstring counts) to its end:
    a typer command's option list is its signature, a declarative table, and is not counted."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno:
            body = node.end_lineno - node.body[0].lineno + 1
            found.append((body, f"{path}:{node.lineno} {node.name}"))
    return found


def main(root: Path) -> None:
    files = sorted(p for pkg in PACKAGES for p in (root / pkg).rglob("*.py"))
    modules = sorted((len(p.read_text().splitlines()), str(p.relative_to(root))) for p in files)
    funcs = sorted(f for p in files for f in functions(p.relative_to(root)))
    print(f"longest modules (of {len(modules)}):")
    for n, name in reversed(modules[-TOP:]):
        print(f"  {n:5d}  {name}")
    print(f"longest function bodies (of {len(funcs)}; signatures such as option lists apart):")
    for n, name in reversed(funcs[-TOP:]):
        print(f"  {n:5d}  {name}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
