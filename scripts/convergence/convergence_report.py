"""Convergence report: docs/results/convergence.md and its plots, from the run records.

python scripts/convergence/convergence_report.py                   # rebuild the report
python scripts/convergence/convergence_report.py --out DIR         # from DIR/convergence/ into DIR
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys

from convergence_runs import (
    EXAMPLES,
    FLAT,
    FLAT_EPOCHS,
    LANGUAGE_MODELS,
    MPI_ARGS,
    ROOT,
    TRANSFORMER_WARMUP,
    Config,
    all_finite,
    common_epoch,
    config_of,
    flattened,
    machine,
    metric,
    pair_by_seed,
)
from convergence_tables import (
    auto_lines,
    flattening_table,
    gap_by_epoch_table,
    machines_lines,
    per_epoch_table,
    retrained_lines,
    summary_table,
    warmup_table,
)


def load_runs(runs_dir):
    """{config key: [records, sorted by seed]} of finished runs."""
    groups = {}
    for name in sorted(os.listdir(runs_dir)) if os.path.isdir(runs_dir) else []:
        if not name.endswith(".json"):
            continue
        with open(os.path.join(runs_dir, name)) as f:
            record = json.load(f)
        if "final" in record and "launch" in record and "config" in record:
            groups.setdefault(record["config"]["key"], []).append(record)
    for records in groups.values():
        records.sort(key=lambda r: r["args"]["seed"])
    return groups


def _current(groups):
    """(groups without the runs that are behind, [the runs held back]).

    A run is behind while it has fewer epochs than another seed of its configuration (a
    campaign that trains one seed at a time, cut between sittings). Averaging its last
    epoch with the other seeds' would mix two points of the LR schedule, so the tables and
    curves that average over seeds leave it out until it catches up; the per-run tables
    still show it.
    """
    kept, behind = {}, []
    for key, records in groups.items():
        most = max(len(r["epochs"]) for r in records)
        kept[key] = [r for r in records if len(r["epochs"]) == most]
        behind += [r for r in records if len(r["epochs"]) < most]
    return kept, behind


def _behind_lines(groups, behind, example=None):
    """One line naming the runs held back (of `example`, or all), or none."""
    mine = [r for r in behind if example is None or r["example"] == example]
    if not mine:
        return []
    runs = "; ".join(
        f"{r['config']['label']} seed {r['args']['seed']}: {len(r['epochs'])} of "
        f"{len(groups[r['config']['key']][0]['epochs'])} epochs"
        + (f" ({r['example']})" if example is None else "")
        for r in mine
    )
    return [
        f"Still training, so left out of the verdicts, summary, gap table and curves until "
        f"they have as many epochs as their configuration's other seeds: {runs}. Their epochs "
        "so far are in the per-run tables."
    ]


def write_plots(groups, out_dir):
    """Writes one PNG per example, its metric by epoch and by bytes sent: {example: file name}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {}
    for example, (_script, _key, label, _higher) in EXAMPLES.items():
        mine = [g for g in groups.values() if g[0]["example"] == example]
        if not mine:
            continue
        fig, (by_epoch, by_bytes) = plt.subplots(1, 2, figsize=(12, 4.5))
        for records in sorted(mine, key=lambda g: config_of(g).key):
            epochs = min(len(r["epochs"]) for r in records)
            xs = list(range(1, epochs + 1))
            per_seed = [[metric(r, e) for e in xs] for r in records]
            mean = [statistics.fmean(v) for v in zip(*per_seed)]
            low = [min(v) for v in zip(*per_seed)]
            high = [max(v) for v in zip(*per_seed)]
            mb = [
                statistics.fmean(sum(e["bytes_sent"] for e in r["epochs"][:k]) for r in records)
                / 1e6
                for k in xs
            ]
            name = f"{config_of(records).label} ({len(records)} seed{'s' * (len(records) > 1)})"
            (line,) = by_epoch.plot(xs, mean, marker="o", markersize=3, label=name)
            by_epoch.fill_between(xs, low, high, color=line.get_color(), alpha=0.2)
            by_bytes.plot(mb, mean, marker="o", markersize=3, color=line.get_color(), label=name)
            by_bytes.fill_between(mb, low, high, color=line.get_color(), alpha=0.2)
        unit = " (%)" if example == "fashion_mnist" else ""
        title = f"{example}: {label}, mean over seeds, band = min-max"
        by_epoch.set(xlabel="epoch", ylabel=label + unit, title=title)
        by_bytes.set(
            xlabel="MB sent per worker (cumulative, log scale)",
            ylabel=label + unit,
            title=f"{example}: {label} vs bytes sent",
            xscale="log",
        )
        if example != "fashion_mnist":
            for ax in (by_epoch, by_bytes):
                ax.set_yscale("log")
        by_epoch.xaxis.get_major_locator().set_params(integer=True)
        for ax in (by_epoch, by_bytes):
            ax.grid(alpha=0.3)
        by_epoch.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, f"convergence_{example}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths[example] = os.path.basename(path)
    return paths


# (example, rank, rounds, start_iter): (largest loss vs plain, least compression)
TARGETS = {
    ("fashion_mnist", 2, 2, 0): (0.3, 100.0),
    ("fashion_mnist", 2, 1, 0): (0.3, 200.0),
    ("fashion_mnist", 1, 2, 0): (1.0, None),
    ("lstm_language_model", 4, 2, 0): (2.0, 35.0),
    ("lstm_language_model", 4, 1, 0): (2.0, 35.0),
    # Within 2 % of plain at >= 8x fewer bytes over the whole run, warm-up included.
    ("transformer_lm", 4, 2, TRANSFORMER_WARMUP): (2.0, 8.0),
    ("transformer_lm", 16, 2, TRANSFORMER_WARMUP): (2.0, 8.0),
}


def _targets(groups):
    """One line per target whose configuration and plain baseline both ran."""
    lines = []
    for (example, rank, rounds, start_iter), (loss, ratio) in TARGETS.items():
        plain = groups.get(Config(example, 0).key)
        records = groups.get(Config(example, rank, rounds, start_iter).key)
        if not plain or not records:
            continue
        label = Config(example, rank, rounds, start_iter).label
        plain, mine = pair_by_seed(plain, records)
        plain_mean = statistics.fmean(metric(r) for r in plain)
        seeds = "seeds " + ",".join(str(r["args"]["seed"]) for r in mine)
        seeds += " vs plain " + ",".join(str(r["args"]["seed"]) for r in plain)
        alone = [str(r["args"]["seed"]) for r in records if r not in mine]
        if alone:
            seeds += f" (seed {','.join(alone)}: no plain run to compare with yet)"
        fewer = min(r["final"]["ratio"] for r in records)
        if not all_finite(records):
            lines.append(f"- {example}, {label}: **missed**, diverged (NaN); {seeds}.")
            continue
        at = common_epoch(plain, mine)
        plain_mean = statistics.fmean(metric(r, at) for r in plain)
        mean = statistics.fmean(metric(r, at) for r in mine)
        if example == "fashion_mnist":
            delta, unit = mean - plain_mean, "pp"
            behind = -delta
        else:
            delta, unit = 100 * (mean / plain_mean - 1), "%"
            behind = delta
        ok = behind <= loss and (ratio is None or fewer >= ratio)
        want = f"within {loss} {unit}" + (f", >= {ratio:.0f}x fewer bytes" if ratio else "")
        when, verdict = "", "**met**" if ok else "**missed**"
        if example in LANGUAGE_MODELS:
            both = [*plain, *mine]
            epochs = sorted({len(r["epochs"]) for r in both})
            when = f" after {'/'.join(map(str, epochs))} epochs"
            planned = max(r["args"].get("decay_epochs") or 0 for r in both)
            if epochs[0] < planned:
                # A partial campaign: the LR is still high, and the plain warm-up steps
                # weigh more in the bytes than they will over the whole schedule.
                when += f" (the LR schedule spans {planned}: partial)"
                verdict = "**not decided yet**"
            if len(epochs) > 1:
                when += f", compared at epoch {at}, which all runs have"
            if not all(map(flattened, both)):
                when += " (validation perplexity still falling, so not the flattened result)"
        lines.append(
            f"- {example}, {label}: {verdict} ({want}){when}: "
            f"{delta:+.2f} {unit} vs plain (mean), {fewer:.1f}x fewer bytes; {seeds}."
        )
    return lines


LR_NOTES = {
    "lstm_language_model": '"LR cut after epochs" is read from each run\'s record: the '
    "campaign cuts the LR by 4 at the same epochs in every run (`--lm-lr-drop-after`).",
    "transformer_lm": "Every run follows the same warm-up and cosine (`--tf-decay-epochs`), "
    "so the LR falls every epoch, alike in every run.",
}


def write_report(groups, out_dir):
    """Writes `out_dir`/convergence.md and its plots.

    Args:
        groups: the runs, as `load_runs` returns them.
        out_dir: the report's folder; its convergence-notes.md, if any, goes in near the top.
    """
    every, (groups, behind) = groups, _current(groups)
    plots = write_plots(groups, out_dir)
    lines = [
        "# Convergence: plain Horovod vs PowerSGD, both schedules, several seeds",
        "",
        "Written by `scripts/convergence/convergence.py` (`make convergence`) from the per-run",
        "JSON files in [`convergence/`](convergence/); every number below was measured by that",
        "script.",
        "Each run: 2 workers on one 2-core machine,",
        f'`horovodrun -np 2 -H localhost:2 --mpi-args="{MPI_ARGS}"` with',
        "`OMP_NUM_THREADS=1` (the README's launch settings). Runs of one configuration differ",
        "only by seed; configurations differ only by the PowerSGD flags shown. Bytes are per",
        "worker, as counted by `compression_stats()` (plain: every gradient once per step at",
        "float32). Times are the median training time of one epoch (evaluation excluded),",
        "one median per machine where a configuration's runs trained on more than one.",
        '"vs plain" compares a configuration with plain Horovod over the seeds both have.',
        "",
        f"Report written on: {machine()}, Python {platform.python_version()}. Each run's",
        "record keeps its machine (`launch.machine`; older records have none); a section",
        "lists them where runs of one model trained on different machines.",
        "",
    ]
    notes = os.path.join(out_dir, "convergence-notes.md")
    if os.path.exists(notes):
        with open(notes) as f:
            lines += [f.read().rstrip(), ""]
    targets = _targets(groups)
    if targets:
        lines += ["## Targets, from the runs below", "", *targets, ""]
        lines += [*_behind_lines(groups, behind), ""] if behind else []
    for example in EXAMPLES:
        lines += [f"## {example}", ""]
        mine = {k: g for k, g in groups.items() if g[0]["example"] == example}
        runs = {k: g for k, g in every.items() if g[0]["example"] == example}
        if not mine:
            lines += ["Not run yet.", ""]
            continue
        lines += [*summary_table(example, mine), ""]
        held = _behind_lines(groups, behind, example)
        lines += [*held, ""] if held else []
        flat = flattening_table(runs, example) if example in LANGUAGE_MODELS else []
        if flat:
            lines += [
                "### Did validation perplexity flatten?",
                "",
                f"Flattened: over the last {FLAT_EPOCHS} epochs, validation perplexity improved by",
                f"less than {FLAT:g} % an epoch on average (or got worse). {LR_NOTES[example]}",
                "The classic recipe reads test perplexity at the best validation epoch; the",
                "tables above read the last epoch.",
                "",
                *flat,
                "",
            ]
        gap = gap_by_epoch_table(mine, example) if example in LANGUAGE_MODELS else []
        if gap:
            lines += [
                "### Test perplexity epoch by epoch: is the gap to plain closing?",
                "",
                "Mean over seeds; each configuration against plain over the seeds both have.",
                "",
                *gap,
                "",
            ]
        chose = auto_lines(mine, example)
        if chose:
            lines += ['### rank="auto"', "", *chose]
        again = retrained_lines(runs, example)
        if again:
            lines += ["### Runs trained again", "", *again, ""]
        machines = machines_lines(runs, example)
        if machines:
            lines += ["### Machines", "", *machines, ""]
        if example == "fashion_mnist":
            warm = warmup_table(mine)
            if warm:
                lines += ["### Warm-up (`start_iter`), rank 2, `rounds=2`", ""]
                lines += [
                    "The learning rate is constant, so the epoch-2 record of a 10-epoch run is",
                    "the result of a 2-epoch run with the same seed; both horizons come from",
                    "the same runs. `start_iter` 469 is one epoch.",
                    "",
                    *warm,
                    "",
                ]
        if example in plots:
            lines += [f"![{example}]({plots[example]})", ""]
        lines += ["Commands (from the repository root), one per run:", "", "```"]
        for k in sorted(runs):
            for r in runs[k]:
                lines += [x["command"] for x in [*r.get("earlier_launches", []), r["launch"]]]
        lines += ["```", "", "<details><summary>Every epoch of every run</summary>", ""]
        lines += per_epoch_table(example, runs)
        lines += ["", "</details>", ""]
    with open(os.path.join(out_dir, "convergence.md"), "w") as f:
        f.write("\n".join(lines))


def parse_args(argv=None):
    """The report's flags, from `argv` (default: the command line)."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--out",
        default=os.path.join(ROOT, "docs", "results"),
        help="report folder; the run records are in its convergence/",
    )
    return p.parse_args(argv)


def main(argv=None):
    """Rebuilds the report from the run records in `--out`/convergence/."""
    args = parse_args(argv)
    write_report(load_runs(os.path.join(args.out, "convergence")), args.out)
    print(f"[convergence] report: {os.path.join(args.out, 'convergence.md')}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
