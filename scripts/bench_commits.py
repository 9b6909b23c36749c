"""Benchmark two commits side by side: the same configurations, alternating runs.

Checks out each commit in a temporary worktree (WORKTREE for the working tree
itself), then for every round runs `python -m horovod_powersgd.bench` with the
given arguments once in each tree, the order flipping every round, with this
venv's Python and the tree as the working directory (so its package is the one
imported). Prints, per configuration, each tree's median step time (the median
of its rounds' medians), their ratio, each tree's spread between rounds (the
run's noise), and whether the bytes per step are equal.

    python scripts/bench_commits.py a327053 WORKTREE --rounds 3 -- \\
        -np 2 --warmup-steps 3 --steps 10 --models resnet18,lstm \\
        --bandwidth unlimited,200mbit --configs horovod,powersgd:2,powersgd-1round:2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def checkout(commit: str, scratch: Path) -> Path:
    if commit == "WORKTREE":
        return ROOT
    tree = scratch / commit
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], cwd=ROOT, check=True)
    return tree


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "bench-commits")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    args.out = args.out.resolve()  # the runs write there from the other tree too
    bench = argv[cut + 1 :]  # after "--": the bench's arguments
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[list[dict]]] = {args.old: [], args.new: []}
    with tempfile.TemporaryDirectory() as scratch:
        trees = {c: checkout(c, Path(scratch)) for c in runs}
        try:
            for r in range(args.rounds):
                order = [args.old, args.new] if r % 2 == 0 else [args.new, args.old]
                for commit in order:
                    out = args.out / f"{commit}-{r}.json"
                    cmd = [
                        sys.executable,
                        "-m",
                        "horovod_powersgd.bench",
                        *bench,
                        "--json",
                        str(out),
                    ]
                    subprocess.run(cmd, cwd=trees[commit], check=True)
                    runs[commit].append(json.loads(out.read_text()))
        finally:
            for tree in trees.values():
                if tree != ROOT:
                    subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT)
    print(table(runs, args.old, args.new))
    return 0


def _key(record: dict) -> tuple:
    return record["model"], record["bandwidth"], record["config"], record.get("rank")


def table(runs: dict[str, list[list[dict]]], old: str, new: str) -> str:
    """Markdown: per configuration, both trees' medians, ratio, spread, bytes."""
    by = {c: {} for c in runs}
    for commit, rounds in runs.items():
        for records in rounds:
            for record in records:
                by[commit].setdefault(_key(record), []).append(record)
    lines = [
        f"| model | link | config | {old} ms | {new} ms | new / old | spread {old} | "
        f"spread {new} | bytes equal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted(by[old], key=str):
        a, b = by[old][key], by[new].get(key, [])
        if not b:
            continue
        ma = statistics.median(r["median_step_ms"] for r in a)
        mb = statistics.median(r["median_step_ms"] for r in b)

        def spread(records):
            values = [r["median_step_ms"] for r in records]
            return max(values) / min(values)

        same = {r["bytes_per_step"] for r in a} == {r["bytes_per_step"] for r in b}
        model, bw, config, rank = key
        name = config + (f" r{rank}" if rank else "")
        lines.append(
            f"| {model} | {bw} | {name} | {ma:.1f} | {mb:.1f} | {mb / ma:.3f} | "
            f"{spread(a):.3f} | {spread(b):.3f} | {'yes' if same else 'NO'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
