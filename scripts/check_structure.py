"""Structural rules of the library, checked by `make lint` (docs/architecture.md).

- Only horovod_powersgd/comm.py imports Horovod (the benchmark in bench/, which
  also runs plain Horovod, imports it itself).
- No class over 350 lines, no function over 80 (docstrings not counted).
- No module imports one that sits above it in docs/architecture.md's order.
- The package speaks of itself, not of its history: no "issue N" of this project in
  its text (another project's, "PyTorch issue 74148", names its project first).

    python scripts/check_structure.py
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "horovod_powersgd"
# "issue 46", "issues 54 and 57", not after the name of another project.
OWN_ISSUE = re.compile(r"(?<!PyTorch )(?<!Horovod )(?<!torch )\bissues? \d+", re.IGNORECASE)
MAX_CLASS, MAX_FUNCTION = 350, 80
# The modules from the bottom up: each may import only those before it.
LAYERS = [
    "collectives", "shares", "stepmodel", "config", "linalg", "planner", "layout", "compressor",
    "guard", "monitor", "comm", "reducer", "hierarchy", "tuner", "agreement", "sparse",
    "optimizer", "checkpoint", "__init__",
]  # fmt: skip


def size(node: ast.AST) -> int:
    """Lines of a class or function without the docstrings in it."""
    lines = node.end_lineno - node.lineno + 1
    for inner in ast.walk(node):
        body = getattr(inner, "body", None)
        if isinstance(inner, (ast.ClassDef, ast.FunctionDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                lines -= first.end_lineno - first.lineno + 1
    return lines


def history(root: Path = PACKAGE) -> list[str]:
    """Lines of the package (bench/ included) that cite this project's own issues."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if OWN_ISSUE.search(line):
                found.append(
                    f"{path.relative_to(root.parent)}:{number} cites an issue: {line.strip()}"
                )
    return found


def problems() -> list[str]:
    found = history()
    for path in sorted(PACKAGE.glob("*.py")):
        module = path.stem
        if module not in LAYERS:
            found.append(f"{path.name}: not in LAYERS (add it in its place)")
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module or ""]
                if module != "comm" and any(n.split(".")[0] == "horovod" for n in names):
                    found.append(f"{path.name}:{node.lineno} imports Horovod (only comm.py may)")
                if isinstance(node, ast.ImportFrom) and node.level == 1:
                    target = node.module or node.names[0].name
                    target = target.split(".")[0]
                    if target in LAYERS and LAYERS.index(target) > LAYERS.index(module):
                        found.append(f"{path.name}:{node.lineno} imports {target}, above it")
            if isinstance(node, ast.ClassDef) and size(node) > MAX_CLASS:
                found.append(f"{path.name}: class {node.name} has {size(node)} lines")
            if isinstance(node, ast.FunctionDef) and size(node) > MAX_FUNCTION:
                found.append(f"{path.name}: function {node.name} has {size(node)} lines")
    return found


def main() -> int:
    found = problems()
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
