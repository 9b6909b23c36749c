"""The path of one steady-state step through horovod_powersgd, as it runs, with its size.

Traces one step of a small model (the settings' defaults, statistics on) from
`loss.backward()` (the first gradient hook) until `opt.step()` returns, and
lists every function of the package that ran, in the order each first ran,
with the lines of its body: code only (no docstring, comments or blank lines).
Not counted: the first step's agreement, the drift check every 100 steps and
the statistics' check every 10 (this step is step 5), and the wrapped
optimizer's own step. Three paths, each with its budget in `make lint` or tests/launch:

    python scripts/step_path.py --rounds 2 1 [--markdown] [--max-lines 320]   # flat
    python scripts/step_path.py --auto --rounds 2 1   # rank="auto", settled (a pinned link)
    # hierarchical: two nodes of two workers; rank 0 prints its path
    bash scripts/nodes/two_nodes.sh --rate none -- \
        .venv/bin/python scripts/step_path.py --hierarchical
"""

from __future__ import annotations

import argparse
import ast
import logging
import os
import sys
from pathlib import Path

import horovod.torch as hvd
import torch
from torch import nn

# This tree's package, not the one installed (an editable install may be another checkout's).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
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


def trace_one_step(rounds: int, auto: bool = False, hierarchical: bool = False) -> list:
    """(file, function, body lines) of each package function one step runs, in order.

    `auto`: rank="auto" on a pinned slow link, traced once its plan is taken (the
    model decides at once: no trials) and two steps ran on it. `hierarchical`: on
    nodes of several workers (two_nodes.sh), this rank's path."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.Linear(64, 10))
    settings = dict(rank="auto", auto_link="10mbit") if auto else {}
    opt = hps.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        named_parameters=model.named_parameters(),
        rounds=rounds,
        hierarchical=hierarchical,
        **settings,
    )

    def loss():
        opt.zero_grad()
        return model(torch.randn(16, 64)).pow(2).mean()

    taken, steady = _PlanTaken(), 0
    while steady < 4:  # the first step agrees and checks; auto measures and plans first
        loss().backward()
        opt.step()
        steady += taken.seen or not auto
        if opt.compression_stats()["steps"] > 64:
            raise RuntimeError("auto took no plan in 64 steps")
    logging.getLogger("horovod_powersgd").removeHandler(taken)
    if hierarchical and "bytes_in_node" not in opt.compression_stats():
        raise RuntimeError("flat: hierarchical needs nodes of several workers (two_nodes.sh)")
    if auto and not any(row["method"] == "powersgd" for row in opt.compression_stats()["plan"]):
        raise RuntimeError("auto took no compressed plan: nothing of PowerSGD to trace")
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


class _PlanTaken(logging.Handler):
    """Notes auto's log line of a plan taken (its public word that it has settled)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.seen = False
        logger = logging.getLogger("horovod_powersgd")
        logger.setLevel(logging.INFO)
        logger.addHandler(self)

    def emit(self, record):
        self.seen = self.seen or "(taken)" in record.getMessage()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, nargs="+", choices=(1, 2), default=[2],
                        help="each schedule given, traced in turn in this process")  # fmt: skip
    parser.add_argument("--auto", action="store_true", help='rank="auto", once settled')
    parser.add_argument(
        "--hierarchical", action="store_true", help="nodes of several workers (two_nodes.sh)"
    )
    parser.add_argument("--markdown", action="store_true", help="a table for docs/")
    parser.add_argument("--max-lines", type=int, help="fail (exit 1) above this many lines")
    args = parser.parse_args()
    hvd.init(process_sets="dynamic" if args.hierarchical else None)
    totals = [report(rounds, args) for rounds in args.rounds]
    if args.max_lines is not None and max(totals) > args.max_lines:
        sys.exit(f"a step's path has {max(totals)} lines, more than --max-lines {args.max_lines}")


def report(rounds: int, args) -> int:
    """Prints the path of one step with `rounds` (rank 0), and returns its lines."""
    paths = hvd.allgather_object(trace_one_step(rounds, args.auto, args.hierarchical))
    # Ranks' paths differ where their shares do (hierarchical): the longest is counted.
    rank, path = max(enumerate(paths), key=lambda rank_path: sum(n for *_, n in rank_path[1]))
    total = sum(n for _, _, n in path)
    if hvd.rank() != 0:
        return total
    what = f"rounds={rounds}" + " auto" * args.auto + " hierarchical" * args.hierarchical
    what += f" (rank {rank} of {len(paths)}, the longest)" * (len(paths) > 1)
    if args.markdown:
        print(f"{what}\n\n| # | function | lines |\n|---|---|---|")
        for i, (f, name, n) in enumerate(path, 1):
            print(f"| {i} | `{f}:{name}` | {n} |")
        print(f"| | **{len(path)} functions** | **{total}** |\n")
    else:
        for f, name, n in path:
            print(f"{f}:{name} {n}")
        print(f"{what}: {len(path)} functions, {total} lines")
    return total


if __name__ == "__main__":
    main()
