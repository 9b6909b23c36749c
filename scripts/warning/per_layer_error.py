"""Plot and tabulate per-layer relative error from the examples' TensorBoard logs.

Reads runs written with ``--tensorboard RUNS/<example>/rank<R>`` (the commands
are in docs/results/per_layer_error.md), then writes, per example, a PNG of
``relative_error/<layer>`` over the steps, one panel per PowerSGD rank, and
prints a Markdown table of each layer's relative error and error/gradient
ratio averaged over the last ``--tail`` logged steps.

    python scripts/warning/per_layer_error.py --runs runs/per_layer --out docs/results
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def read_run(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value), ...] of one run's scalars."""
    events = EventAccumulator(str(directory))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def runs_of(example_dir: Path) -> dict[int, dict]:
    """PowerSGD rank -> scalars, for the rank<R> folders of one example."""
    out = {}
    for run in sorted(example_dir.iterdir()):
        match = re.fullmatch(r"rank(\d+)", run.name)
        if match:
            out[int(match.group(1))] = read_run(run)
    return out


def layers(scalars: dict) -> list[str]:
    return sorted(t.split("/", 1)[1] for t in scalars if t.startswith("relative_error/"))


def tail_mean(points: list[tuple[int, float]], tail: int) -> float:
    last = points[-1][0]
    values = [v for s, v in points if s > last - tail]
    return sum(values) / len(values)


def table(example: str, runs: dict[int, dict], tail: int) -> str:
    ranks = sorted(runs)
    names = sorted({name for r in ranks for name in layers(runs[r])})
    head = "| layer | " + " | ".join(f"rank {r}: rel. error, error/grad" for r in ranks) + " |"
    rows = [f"**{example}**", "", head, "|---" * (len(ranks) + 1) + "|"]
    for name in names:
        cells = []
        for r in ranks:
            if f"relative_error/{name}" not in runs[r]:
                cells.append("not compressed")
                continue
            rel = tail_mean(runs[r][f"relative_error/{name}"], tail)
            ratio = tail_mean(runs[r][f"error_ratio/{name}"], tail)
            cells.append(f"{rel:.3f}, {ratio:.1f}")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    metrics = [t for t in runs[ranks[0]] if t.startswith(("test/", "valid/"))]
    for tag in sorted(metrics):
        values = " | ".join(f"{runs[r][tag][-1][1]:.4g}" for r in ranks)
        rows.append(f"| *{tag}* | {values} |")
    return "\n".join(rows)


def plot(example: str, runs: dict[int, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted(runs)
    names = sorted({name for r in ranks for name in layers(runs[r])})
    colors = {name: f"C{i}" for i, name in enumerate(names)}  # one colour per layer
    fig, axes = plt.subplots(1, len(ranks), figsize=(4.2 * len(ranks), 3.6), sharey=True)
    for ax, r in zip(axes, ranks):
        for name in layers(runs[r]):
            steps, values = zip(*runs[r][f"relative_error/{name}"])
            ax.plot(steps, values, label=name, color=colors[name])
        ax.set_title(f"{example}, PowerSGD rank {r}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("relative error ‖M − P̂Qᵀ‖ / ‖M‖ (mean of ranks)")
    handles = [plt.Line2D([], [], color=colors[n], label=n) for n in names]
    axes[0].legend(handles=handles, fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, required=True, help="folder of <example>/rank<R>")
    parser.add_argument("--out", type=Path, required=True, help="folder for the PNGs")
    parser.add_argument("--tail", type=int, default=100, help="steps averaged in the table")
    args = parser.parse_args()
    for example_dir in sorted(p for p in args.runs.iterdir() if p.is_dir()):
        runs = runs_of(example_dir)
        if not runs:
            continue
        path = args.out / f"per_layer_error_{example_dir.name}.png"
        plot(example_dir.name, runs, path)
        print(table(example_dir.name, runs, args.tail), end="\n\n")
        print(f"wrote {path}\n")


if __name__ == "__main__":
    main()
