"""The path of one steady-state step through horovod_powersgd, as it runs, with its size.

Traces one step of a small model (the settings' defaults, statistics on) from
`loss.backward()` (the first gradient hook) until `opt.step()` returns, and
lists every function of the package that ran, in the order each first ran,
with the lines of its body: code only (no docstring, comments or blank lines).
Not counted: the first step's agreement, the drift check every 100 steps and
the statistics' check every 10 (this step is step 5), and the wrapped
optimizer's own step.

    python scripts/step_path.py --rounds 2 [--markdown] [--max-lines 300]
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
from pathlib import Path

import horovod.torch as hvd
import torch
from torch import nn

import horovod_powersgd as hps

PACKAGE = os.path.dirname(hps.__file__)


def body_lines(path: str, first_line: int) -> int:
    """Code lines of the body of the function defined at `first_line` of `path`."""
    source = Path(path).read_text()
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef):
            start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            if first_line in (node.lineno, start):
                break
    else:
        raise LookupError(f"no function at {path}:{first_line}")
    body = node.body
    if isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]  # the docstring
    if not body:
        return 0
    code = [line.strip() for line in lines[body[0].lineno - 1 : node.end_lineno]]
    return sum(1 for line in code if line and not line.startswith("#"))


def trace_one_step(rounds: int) -> list[tuple[str, str, int]]:
    """(file, function, body lines) of each package function one step runs, in order."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.Linear(64, 10))
    opt = hps.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        named_parameters=model.named_parameters(),
        rounds=rounds,
    )

    def loss():
        opt.zero_grad()
        return model(torch.randn(16, 64)).pow(2).mean()

    for _ in range(4):  # the first step agrees and checks; then the steady state
        loss().backward()
        opt.step()
    seen: dict[tuple[str, int, str], None] = {}

    def profile(frame, event, arg):
        code = frame.f_code
        # Comprehensions and lambdas are lines of the function around them.
        if event == "call" and code.co_filename.startswith(PACKAGE) and code.co_name[0] != "<":
            name = getattr(code, "co_qualname", code.co_name)  # Class.method (Python 3.11+)
            seen.setdefault((code.co_filename, code.co_firstlineno, name))

    step_loss = loss()
    sys.setprofile(profile)
    try:
        step_loss.backward()
        opt.step()
    finally:
        sys.setprofile(None)
    root = os.path.dirname(PACKAGE)
    return [(os.path.relpath(f, root), name, body_lines(f, line)) for f, line, name in seen]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, choices=(1, 2), default=2)
    parser.add_argument("--markdown", action="store_true", help="a table for docs/")
    parser.add_argument("--max-lines", type=int, help="fail (exit 1) above this many lines")
    args = parser.parse_args()
    hvd.init()
    path = trace_one_step(args.rounds)
    total = sum(n for _, _, n in path)
    if args.markdown:
        print("| # | function | lines |\n|---|---|---|")
        for i, (f, name, n) in enumerate(path, 1):
            print(f"| {i} | `{f}:{name}` | {n} |")
        print(f"| | **{len(path)} functions** | **{total}** |")
    else:
        for f, name, n in path:
            print(f"{f}:{name} {n}")
        print(f"rounds={args.rounds}: {len(path)} functions, {total} lines")
    if args.max_lines is not None and total > args.max_lines:
        sys.exit(f"the step's path has {total} lines, more than --max-lines {args.max_lines}")


if __name__ == "__main__":
    main()
