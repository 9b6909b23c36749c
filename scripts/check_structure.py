"""Structural rules of the library, checked by `make lint` (docs/architecture.md).

- Only horovod_powersgd/comm.py imports Horovod (the benchmark in bench/, which
  also runs plain Horovod, imports it itself).
- No class over 350 lines, no function over 80 (docstrings not counted).
- No module imports one that sits above it in docs/architecture.md's order.
- The package speaks of itself, not of its history: no "issue N" of this project in
  its text (another project's, "PyTorch issue 74148", names its project first).
- No module reaches into another's private members: `x._name` (x not self or cls)
  only where the module itself defines `_name` (its own classes' members, read on
  another instance) or x is a module imported from outside the package (torch's
  `torch._foreach_norm`). A part another module needs is public on its owner
  (the optimizer's PowerSGD state, state.py, is handed to the tuner and agreement).

    python scripts/check_structure.py [--floors]

`--floors` prints each module's floor instead (bench/ as one room): 1 where it
imports no other module of the package, else one above the highest it imports.
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
    "collectives", "shares", "stepmodel", "config", "linalg", "planner", "layout", "graphs",
    "compressor", "guard", "monitor", "comm", "reducer", "hierarchy", "tuner", "agreement",
    "sparse", "state", "optimizer", "checkpoint", "__init__",
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


def _defined_private(tree: ast.AST) -> set[str]:
    """The private names a module defines: functions, classes, and its instances' or its
    own names it assigns (`self._x = ...`, `_X = ...`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            for inner in ast.walk(target):
                owner = getattr(inner, "value", None)
                if isinstance(inner, ast.Attribute) and getattr(owner, "id", "") in ("self", "cls"):
                    names.add(inner.attr)
                elif isinstance(inner, ast.Name):
                    names.add(inner.id)
    return {name for name in names if name.startswith("_")}


def _outside_modules(tree: ast.AST) -> set[str]:
    """Names bound by imports from outside the package (`import torch`, `from x import y`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.update(a.asname or a.name for a in node.names)
    return names


def private_reach(root: Path = PACKAGE) -> list[str]:
    """Places where a module of the package (bench/ included) reads or sets another
    module's private member (see the module's docstring)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree, here = ast.parse(path.read_text()), []
        own, outside = _defined_private(tree), _outside_modules(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")):
                continue
            if node.attr.startswith("__") or node.attr in own:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            origin = node.value
            while isinstance(origin, ast.Attribute):
                origin = origin.value
            if isinstance(origin, ast.Name) and origin.id in outside:
                continue
            here.append((node.lineno, ast.unparse(node)))
        found += [
            f"{path.relative_to(root.parent)}:{line} reaches into a private member: {text}"
            for line, text in sorted(here)
        ]
    return found


def problems() -> list[str]:
    found = history() + private_reach()
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


def _imports(path: Path, depth: int) -> set[str]:
    """The package's modules a file at `depth` below the package imports (bench/ by name)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):  # import horovod_powersgd[.x]
            parts = [a.name.split(".") for a in node.names if a.name.startswith("horovod_powersgd")]
            found |= {p[1] if len(p) > 1 else "__init__" for p in parts}
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level == depth:  # from . import x (depth 1); from .. import x (in bench/)
            found |= {node.module} if node.module else {a.name for a in node.names}
        elif node.level == 0 and (node.module or "").startswith("horovod_powersgd"):
            parts = node.module.split(".")
            found |= {parts[1]} if len(parts) > 1 else {a.name for a in node.names} | {"__init__"}
    return {"bench/" if name == "bench" else name.split(".")[0] for name in found}


def floors(root: Path = PACKAGE) -> dict[str, int]:
    """Each module's floor, bench/ as one room: 1 where it imports no other module of the
    package, else one above the highest it imports (docs/architecture.md draws them)."""
    imports = {path.stem: _imports(path, 1) for path in root.glob("*.py")}
    imports["bench/"] = set().union(*(_imports(p, 2) for p in (root / "bench").glob("*.py")))
    floor: dict[str, int] = {}

    def of(module: str) -> int:
        if module not in floor:
            below = [of(m) for m in imports[module] if m in imports and m != module]
            floor[module] = 1 + max(below, default=0)
        return floor[module]

    for module in imports:
        of(module)
    return floor


def main() -> int:
    if sys.argv[1:] == ["--floors"]:  # the rooms from the top floor down, with their lines
        for module, number in sorted(floors().items(), key=lambda item: (-item[1], item[0])):
            path = PACKAGE / (module if module.endswith("/") else f"{module}.py")
            files = list(path.glob("*.py")) if path.is_dir() else [path]
            print(
                f"floor {number}  {module}  {sum(len(f.read_text().splitlines()) for f in files)}"
            )
        return 0
    found = problems()
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
