"""Accuracy of hierarchical PowerSGD: Fashion-MNIST CNN on two nodes of two workers.

    python scripts/convergence/hierarchical_accuracy.py [--seeds 1,2,3] [--epochs 2]  # the missing
    python scripts/convergence/hierarchical_accuracy.py --report                      # the table

Per seed, three runs on scripts/nodes/two_nodes.sh (node link 100 Mbit/s): plain
Horovod, flat PowerSGD rank 2 and hierarchical rank 2, the example's defaults
otherwise. Each run's record lands in docs/results/hierarchical/accuracy/ as it
finishes (a run already there is not repeated), so the campaign runs in pieces.
The report compares each PowerSGD run's test accuracy and loss with plain
Horovod's of the same seed, and the per-layer relative error
‖M − P̂·Qᵀ‖/‖M‖ at the end (the ranks' moving average, `compression_stats`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs/results/hierarchical/accuracy"
CONFIGS = {
    "plain": ["--powersgd-rank", "0"],
    "flat-r2": ["--powersgd-rank", "2"],
    "hierarchical-r2": ["--powersgd-rank", "2", "--hierarchical", "on"],
}


def run(config: str, seed: int, epochs: int) -> None:
    path = OUT / f"{config}-seed{seed}.json"
    if path.exists() and "final" in json.loads(path.read_text()):
        return
    cmd = ["bash", str(ROOT / "scripts/nodes/two_nodes.sh"), "--rate", "100mbit",
           "--timeout", "3000", "--", str(ROOT / ".venv/bin/python"),
           str(ROOT / "examples/fashion_mnist.py"),
           "--epochs", str(epochs), "--seed", str(seed), "--no-progress",
           "--json", str(path), *CONFIGS[config]]  # fmt: skip
    print(f"[accuracy] {config} seed {seed} ...", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def report() -> str:
    runs = {}
    for path in sorted(OUT.glob("*.json")):
        record = json.loads(path.read_text())
        if "final" not in record:  # still running (the example writes every epoch)
            continue
        config, seed = path.stem.rsplit("-seed", 1)
        runs[(config, int(seed))] = record
    seeds = sorted({s for _, s in runs})
    lines = ["| seed | config | test accuracy | vs plain | test loss | mean relative error |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    gaps = {c: [] for c in CONFIGS}
    errors = {c: [] for c in CONFIGS}
    for seed in seeds:
        plain = runs.get(("plain", seed))
        for config in CONFIGS:
            record = runs.get((config, seed))
            if record is None:
                continue
            last = record["epochs"][-1]
            gap = (
                ""
                if plain is None
                else last["test_accuracy"] - plain["epochs"][-1]["test_accuracy"]
            )
            layer = record["final"].get("relative_error") or {}
            known = [v for v in layer.values() if v is not None]
            mean_error = statistics.mean(known) if known else None
            if gap != "":
                gaps[config].append(gap)
            if mean_error is not None:
                errors[config].append(mean_error)
            lines.append(
                f"| {seed} | {config} | {last['test_accuracy']:.4f} | "
                f"{'' if gap == '' else f'{gap:+.4f}'} | {last['test_loss']:.4f} | "
                f"{'' if mean_error is None else f'{mean_error:.3f}'} |"
            )
    lines.append("")
    for config in CONFIGS:
        if gaps[config] and config != "plain":
            lines.append(
                f"- {config}: mean accuracy gap to plain {statistics.mean(gaps[config]):+.4f} "
                f"over {len(gaps[config])} seeds; mean relative error "
                f"{statistics.mean(errors[config]) if errors[config] else float('nan'):.3f}"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--report", action="store_true")
    args = p.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if not args.report:
        for seed in (int(s) for s in args.seeds.split(",")):
            for config in CONFIGS:
                run(config, seed, args.epochs)
    print(report())


if __name__ == "__main__":
    main()
