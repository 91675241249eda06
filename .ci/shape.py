"""Code-shape gate: no module over 450 lines, no function over 80, a role docstring on every file.

Issue 11 set these limits for tail_ray/ and service/ so that each module keeps one job and each
function fits on a screen. Run from the repository root (``.ci/run`` does, next to ruff and
mypy); it prints ``path:line: what`` for each breach and exits 1 if there is any.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80
ROOTS = ("tail_ray", "service")

# Files exempt from the module-length limit, each with the reason and who removes the entry.
# None today (service/storage.py, the last one, is now the package service/storage/).
MODULE_LENGTH_ALLOWED: set[str] = set()


def breaches(path: Path, rel: str) -> list[str]:
    """Every limit ``path`` breaks, as ``rel:line: message`` lines."""
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text, filename=rel)
    found = []
    lines = len(text.splitlines())
    if lines > MAX_MODULE_LINES and rel not in MODULE_LENGTH_ALLOWED:
        found.append(f"{rel}:1: module has {lines} lines (limit {MAX_MODULE_LINES})")
    doc = ast.get_docstring(tree, clean=True)
    if not doc or not doc.splitlines()[0].strip():
        found.append(f"{rel}:1: no docstring saying the module's role on its first line")
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            # Decorators count as part of the function: they are read with it.
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            length = (node.end_lineno or node.lineno) - start + 1
            if length > MAX_FUNCTION_LINES:
                found.append(
                    f"{rel}:{start}: function {node.name} has {length} lines (limit {MAX_FUNCTION_LINES})"
                )
    return found


def main(repo: Path) -> int:
    found = []
    for root in ROOTS:
        for path in sorted((repo / root).rglob("*.py")):
            found += breaches(path, path.relative_to(repo).as_posix())
    for stale in sorted(MODULE_LENGTH_ALLOWED):
        path = repo / stale
        if not path.exists() or len(path.read_text(encoding="utf-8").splitlines()) <= MAX_MODULE_LINES:
            found.append(f"{stale}:1: allowed to be long but is not (any more): drop it from the list")
    for line in found:
        print(line)
    if found:
        print(f"shape: {len(found)} breach(es)", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(Path.cwd()))
