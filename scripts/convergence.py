"""Convergence campaign: plain Horovod vs PowerSGD, both schedules, several seeds.

    python scripts/convergence.py                          # every part (many hours)
    python scripts/convergence.py --parts transformer      # the transformer (about 11 hours)
    python scripts/convergence.py --parts fashion,warmup   # Fashion-MNIST only
    python scripts/convergence.py --deadline 09:40         # start no run after 09:40 UTC
    python scripts/convergence.py --parts transformer --only transformer_lm-plain  # one config
    python scripts/convergence.py --parts lstm --lm-epochs 24  # train the LSTM runs on
    python scripts/convergence.py --report-only            # rebuild the report

How the campaign is run, and why: docs/results/convergence-notes.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_BIN = os.path.join(ROOT, ".venv", "bin")

# The launcher settings the README recommends: without yield-when-idle, a rank waiting in
# MPI spins on a core the other rank needs (2 workers on 2 cores).
MPI_ARGS = "--mca mpi_yield_when_idle 1"

EXAMPLES = {
    # name: (script, metric key, label, higher is better)
    "fashion_mnist": ("examples/fashion_mnist.py", "test_accuracy", "test accuracy", True),
    "lstm_language_model": (
        "examples/lstm_language_model.py",
        "test_perplexity",
        "test perplexity",
        False,
    ),
    "transformer_lm": ("examples/transformer_lm.py", "test_perplexity", "test perplexity", False),
}
FASHION_STEPS_PER_EPOCH = 469  # 60,000 images / (2 workers x 64)
# examples/transformer_lm.py's --warmup-steps default: the LR warm-up, and start_iter with it.
TRANSFORMER_WARMUP = 200
TRANSFORMER_RANKS = (4, 16)
LANGUAGE_MODELS = ("lstm_language_model", "transformer_lm")
CHECKPOINTS = os.path.join("runs", "convergence")  # from ROOT; ignored by git (tens of MB)


def machine() -> str:
    """This machine's processor and cores, as each run's record keeps them.

    Sessions here get machines of one kind but not always the same CPU: a run repeated on
    another CPU does not repeat bitwise (other BLAS kernels, other summation order), and
    epoch times compare only between runs of one CPU.
    """
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor is enough: all are alike here
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return f"{name}, {os.cpu_count()} cores"


@dataclass(frozen=True)
class Config:
    """One configuration; its runs differ only by seed."""

    example: str
    rank: int  # 0 = plain Horovod
    rounds: int = 2
    start_iter: int = 0

    @property
    def key(self) -> str:
        if self.rank == 0:
            return f"{self.example}-plain"
        return f"{self.example}-r{self.rank}-rounds{self.rounds}-si{self.start_iter}"

    @property
    def label(self) -> str:
        if self.rank == 0:
            return "plain Horovod"
        text = f"rank {self.rank}, rounds={self.rounds}"
        return text + (f", start_iter {self.start_iter}" if self.start_iter else "")


PARTS = ("fashion", "warmup", "lstm", "transformer")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--np", type=int, default=2, help="workers per run")
    p.add_argument(
        "--parts", default=",".join(PARTS), help="any of " + ", ".join(PARTS) + ", comma-separated"
    )
    p.add_argument("--seeds", default="42,43,44", help="Fashion-MNIST seeds")
    p.add_argument("--lm-seeds", default="42,43", help="LSTM seeds")
    p.add_argument("--cnn-epochs", type=int, default=10, help="Fashion-MNIST epochs")
    p.add_argument("--lm-epochs", type=int, default=20, help="LSTM epochs")
    p.add_argument(
        "--lm-lr-drop-after",
        default="14",
        help="LSTM: divide the LR by 4 after these epochs in every run ('' = when validation "
        "stalls, which cuts each run at its own epoch)",
    )
    p.add_argument("--tf-seeds", default="42,43", help="transformer seeds")
    p.add_argument("--tf-epochs", type=int, default=8, help="transformer epochs")
    p.add_argument(
        "--tf-decay-epochs",
        type=int,
        default=8,
        help="transformer: the cosine LR schedule reaches its floor after this many epochs",
    )
    p.add_argument(
        "--lm-train-tokens", type=int, default=0, help="LSTM, transformer training tokens; 0 = all"
    )
    p.add_argument(
        "--lm-eval-tokens", type=int, default=0, help="LSTM, transformer eval tokens; 0 = all"
    )
    p.add_argument("--extra", default="", help="more flags for every run ('--max-steps 3')")
    p.add_argument("--deadline", default=None, help="HH:MM UTC: start no run after this time")
    p.add_argument(
        "--only",
        default="",
        help="run only these configurations of the plan, comma-separated keys as in the JSON "
        "file names ('transformer_lm-plain,transformer_lm-r4-rounds2-si200')",
    )
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "results"), help="report folder")
    p.add_argument("--rerun", action="store_true", help="rerun runs that already finished")
    p.add_argument("--report-only", action="store_true", help="only rebuild the report")
    return p.parse_args(argv)


def _ints(text):
    return [int(x) for x in text.split(",") if x]


def run_plan(args):
    """[(name, config, seed, argv)] in the order they run."""
    parts = set(args.parts.split(","))
    unknown = parts - set(PARTS)
    if unknown:
        raise SystemExit(f"unknown --parts {sorted(unknown)}; use {', '.join(PARTS)}")
    seeds, lm_seeds, tf_seeds = _ints(args.seeds), _ints(args.lm_seeds), _ints(args.tf_seeds)
    plain, r2 = Config("fashion_mnist", 0), Config("fashion_mnist", 2)
    r2_one = Config("fashion_mnist", 2, rounds=1)
    others = [Config("fashion_mnist", 1), Config("fashion_mnist", 4)]
    warmups = [Config("fashion_mnist", 2, start_iter=s) for s in (100, FASHION_STEPS_PER_EPOCH)]
    lstm = [Config("lstm_language_model", 0)]
    lstm += [Config("lstm_language_model", 4, rounds=r) for r in (2, 1)]
    transformer = [Config("transformer_lm", 0)]
    transformer += [
        Config("transformer_lm", r, start_iter=TRANSFORMER_WARMUP) for r in TRANSFORMER_RANKS
    ]

    order = []  # (config, seed): seed 42 of everything first, then the other seeds
    if "fashion" in parts:
        order += [(c, seeds[0]) for c in (plain, r2, r2_one, *others)]
    if "warmup" in parts:
        order += [(c, seeds[0]) for c in warmups]
    if "fashion" in parts:
        order += [(c, s) for s in seeds[1:] for c in (plain, r2, r2_one)]
        order += [(c, s) for s in seeds[1:] for c in others]
    if "warmup" in parts:
        order += [(c, s) for s in seeds[1:] for c in warmups]
    if "lstm" in parts:
        order += [(c, s) for s in lm_seeds for c in lstm]
    if "transformer" in parts:
        order += [(c, s) for s in tf_seeds for c in transformer]

    plan = []
    for config, seed in order:
        name = f"{config.key}-s{seed}"
        argv = ["--seed", str(seed), "--no-progress", "--powersgd-rank", str(config.rank)]
        argv += ["--rounds", str(config.rounds), "--start-iter", str(config.start_iter)]
        if config.example == "fashion_mnist":
            argv += ["--epochs", str(args.cnn_epochs)]
        else:
            if config.example == "lstm_language_model":
                argv += ["--epochs", str(args.lm_epochs)]
                if args.lm_lr_drop_after:
                    argv += ["--lr-drop-after", args.lm_lr_drop_after]
            else:
                argv += ["--epochs", str(args.tf_epochs), "--decay-epochs"]
                argv += [str(args.tf_decay_epochs), "--warmup-steps", str(TRANSFORMER_WARMUP)]
            argv += ["--train-subset", str(args.lm_train_tokens)]
            argv += ["--eval-subset", str(args.lm_eval_tokens)]
            # Saved after every epoch: an interrupted run, or one asked for more
            # --lm-epochs later, goes on from its last epoch.
            argv += ["--checkpoint", os.path.join(CHECKPOINTS, f"{name}.ckpt")]
        plan.append((name, config, seed, argv + shlex.split(args.extra)))
    if args.only:
        only = set(args.only.split(","))
        unknown = only - {config.key for _, config, _, _ in plan}
        if unknown:
            keys = sorted({config.key for _, config, _, _ in plan})
            raise SystemExit(f"--only {sorted(unknown)}: not in this plan; its keys: {keys}")
        plan = [run for run in plan if run[1].key in only]
    return plan


def _past(deadline):
    if not deadline:
        return False
    hours, minutes = (int(x) for x in deadline.split(":"))
    now = time.gmtime()
    return (now.tm_hour, now.tm_min) >= (hours, minutes)


def run_one(name, config, argv, args, runs_dir):
    json_path = os.path.join(runs_dir, f"{name}.json")
    log_path = os.path.join(runs_dir, f"{name}.log")
    earlier, replaced = [], []
    if os.path.exists(json_path) and not args.rerun:
        with open(json_path) as f:
            old = json.load(f)
        wanted = int(argv[argv.index("--epochs") + 1])
        if "--lr-drop-after" in argv:
            # The last epoch's cut only sets the next epoch's LR, which the plan decides.
            done = len(old["epochs"])
            planned = [d for d in _ints(argv[argv.index("--lr-drop-after") + 1]) if d < done]
            cuts = [c for c in _lr_cuts(old) if c < done]
            if cuts != planned:
                print(
                    f"[convergence] {name}: its LR was cut after epochs {cuts or 'none'}, "
                    f"this plan cuts after {planned or 'none'}; not run. Move {json_path} and "
                    f"its checkpoint away to run it again with this schedule",
                    flush=True,
                )
                return
        if "launch" in old and len(old["epochs"]) >= wanted:
            print(f"[convergence] {name}: already done, skipping", flush=True)
            return
        checkpoint = argv[argv.index("--checkpoint") + 1] if "--checkpoint" in argv else None
        if "launch" in old and checkpoint and not os.path.exists(os.path.join(ROOT, checkpoint)):
            # Checkpoints stay on the machine that trained (not in git): on another one the
            # run cannot go on, so it trains again from epoch 1. The earlier record is kept
            # in the new one, which also shows how closely a run reproduces.
            print(
                f"[convergence] {name}: {len(old['epochs'])} epochs recorded, but its "
                f"checkpoint {checkpoint} is not on this machine; training again from epoch 1",
                flush=True,
            )
            replaced = [*old.get("replaced_runs", [])]
            replaced.append(
                {k: old[k] for k in ("epochs", "launch", "earlier_launches") if k in old}
            )
        elif "launch" in old:  # finished with fewer epochs: the example goes on from its checkpoint
            earlier = [*old.get("earlier_launches", []), old["launch"]]
    command = [
        os.path.join(VENV_BIN, "horovodrun"), "-np", str(args.np), "-H", f"localhost:{args.np}",
        f"--mpi-args={MPI_ARGS}", os.path.join(VENV_BIN, "python"), EXAMPLES[config.example][0],
        *argv, "--json", os.path.relpath(json_path, ROOT),
    ]  # fmt: skip
    shown = " ".join(
        shlex.quote(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c) for c in command
    )
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    print(f"[convergence] {name}: {shown}", flush=True)
    load_before = os.getloadavg()
    start = time.time()
    # A run that goes on from its checkpoint keeps the earlier launches' output in its log.
    going_on = os.path.exists(json_path) and not args.rerun and not replaced
    with open(log_path, "a" if going_on else "w") as log:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
        log.write(f"[convergence] launched {stamp} UTC: {shown}\n")
        log.flush()
        proc = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.time() - start
    if proc.returncode != 0 or not os.path.exists(json_path):
        print(f"[convergence] {name}: FAILED (exit {proc.returncode}), see {log_path}", flush=True)
        return
    with open(json_path) as f:
        record = json.load(f)
    record["config"] = {"key": config.key, "label": config.label, **config.__dict__}
    record["launch"] = {
        "command": f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']} {shown}",
        "wall_s": wall,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(start)),
        "machine": machine(),
    }
    if record.get("resumed_after_epoch"):
        record["earlier_launches"] = earlier
    if replaced:
        record["replaced_runs"] = replaced
    with open(json_path, "w") as f:
        json.dump(record, f, indent=2)
    print(f"[convergence] {name}: done in {wall:.0f} s", flush=True)


# --- the report ---------------------------------------------------------------------------


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


def _config(records):
    c = records[0]["config"]
    return Config(c["example"], c["rank"], c["rounds"], c["start_iter"])


def _scale(example):
    return 100.0 if example == "fashion_mnist" else 1.0


def _value(record, epoch=None):
    """The example's metric after `epoch` (default: the last), in report units."""
    key = EXAMPLES[record["example"]][1]
    e = record["epochs"][-1 if epoch is None else epoch - 1]
    return _scale(record["example"]) * e[key]


def _ratio_through(record, epoch):
    """Uncompressed bytes / bytes sent, over epochs 1..epoch."""
    sent = sum(e["bytes_sent"] for e in record["epochs"][:epoch])
    full = sum(e["bytes_sent"] * e["ratio"] for e in record["epochs"][:epoch])
    return full / sent


def _spread(values):
    """'mean ± sample std (min-max)' text; the std is '—' for one seed."""
    mean = statistics.fmean(values)
    std = f"{statistics.stdev(values):.2f}" if len(values) > 1 else "—"
    return mean, f"{mean:.2f} ± {std} ({min(values):.2f}-{max(values):.2f})"


def _epoch_seconds(records):
    return statistics.median(e["train_time_s"] for r in records for e in r["epochs"])


def _epoch_seconds_text(records):
    """The median epoch time; per machine where the runs trained on more than one.

    One median over runs of different CPUs mixes their speeds, so then each machine's
    median is given, smallest first.
    Runs with no recorded machine count as one machine: nothing tells them apart.
    """
    by_machine = {}
    for r in records:
        by_machine.setdefault(r.get("launch", {}).get("machine"), []).append(r)
    if len(by_machine) < 2:
        return f"{_epoch_seconds(records):.0f} s"
    medians = sorted(_epoch_seconds(runs) for runs in by_machine.values())
    return " / ".join(f"{m:.0f} s" for m in medians) + f" ({len(medians)} machines)"


def _ordered(groups):
    """Configuration keys in report order: plain first, then by rank, then by key."""
    return sorted(groups, key=lambda k: (_config(groups[k]).rank, k))


def _finite(records):
    return all(math.isfinite(_value(r)) for r in records)


def write_plots(groups, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {}
    for example, (_script, _key, label, _higher) in EXAMPLES.items():
        mine = [g for g in groups.values() if g[0]["example"] == example]
        if not mine:
            continue
        fig, (by_epoch, by_bytes) = plt.subplots(1, 2, figsize=(12, 4.5))
        for records in sorted(mine, key=lambda g: _config(g).key):
            epochs = min(len(r["epochs"]) for r in records)
            xs = list(range(1, epochs + 1))
            per_seed = [[_value(r, e) for e in xs] for r in records]
            mean = [statistics.fmean(v) for v in zip(*per_seed)]
            low = [min(v) for v in zip(*per_seed)]
            high = [max(v) for v in zip(*per_seed)]
            mb = [
                statistics.fmean(sum(e["bytes_sent"] for e in r["epochs"][:k]) for r in records)
                / 1e6
                for k in xs
            ]
            name = f"{_config(records).label} ({len(records)} seed{'s' * (len(records) > 1)})"
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


def _late_mean(records, last=3, through=None):
    """Mean over seeds and over the last `last` epochs (up to `through`, default each run's
    last): less sensitive to one noisy epoch."""
    values = [
        _value(r, e) for r in records for e in range(1, (through or len(r["epochs"])) + 1)[-last:]
    ]
    return statistics.fmean(values)


def _common_epoch(*groups):
    """The last epoch every run of `groups` has: runs trained for different epochs compare
    there, at the same point of the LR schedule."""
    return min(len(r["epochs"]) for records in groups for r in records)


def _paired(plain, records):
    """(plain runs, runs of `records`) of the seeds both have; all of both if none match."""
    seeds = {r["args"]["seed"] for r in records} & {r["args"]["seed"] for r in plain}
    if not seeds:
        return plain, records
    return [r for r in plain if r["args"]["seed"] in seeds], [
        r for r in records if r["args"]["seed"] in seeds
    ]


def _delta(example, value, plain):
    if example == "fashion_mnist":
        return f"{value - plain:+.2f} pp"
    return f"{100 * (value / plain - 1):+.1f} %"


def _summary_table(example, groups):
    label = EXAMPLES[example][2]
    plain = groups.get(Config(example, 0).key)
    lines = [
        f"| configuration | seeds | epochs | final {label}: mean ± std (min-max) | vs plain "
        "| last 3 epochs: mean | vs plain | bytes / epoch / worker | fewer bytes "
        "| train time / epoch (median) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in _ordered(groups):
        records = groups[key]
        if records[0]["example"] != example:
            continue
        values = [_value(r) for r in records]
        if _finite(records):
            mean, text = _spread(values)
        else:
            mean, text = (
                float("nan"),
                "diverged (NaN) in "
                + ", ".join(
                    str(r["args"]["seed"]) for r in records if not math.isfinite(_value(r))
                ),
            )
        late = _late_mean(records)
        if not plain or _config(records).rank == 0 or not math.isfinite(mean):
            delta = late_delta = "—"
        else:
            same, mine = _paired(plain, records)
            at = _common_epoch(same, mine)
            mean_same = statistics.fmean(_value(r, at) for r in mine)
            delta = _delta(example, mean_same, statistics.fmean(_value(r, at) for r in same))
            late_delta = _delta(example, _late_mean(mine, through=at), _late_mean(same, through=at))
            if any(len(r["epochs"]) != at for r in [*same, *mine]):
                delta += f" (epoch {at})"
                late_delta += f" (epochs {max(1, at - 2)}-{at})"
        epochs = len(records[0]["epochs"])
        per_epoch = statistics.fmean(r["final"]["bytes_sent"] / epochs for r in records)
        ratios = [r["final"]["ratio"] for r in records]
        ratio = f"{min(ratios):.1f}x" + (
            f"-{max(ratios):.1f}x" if max(ratios) - min(ratios) > 0.05 else ""
        )
        seeds = ",".join(str(r["args"]["seed"]) for r in records)
        lines.append(
            f"| {_config(records).label} | {seeds} | {epochs} | {text} | {delta} "
            f"| {late:.2f} | {late_delta} | {per_epoch / 1e6:.1f} MB | {ratio} "
            f"| {_epoch_seconds_text(records)} |"
        )
    return lines


def _warmup_table(groups):
    configs = [Config("fashion_mnist", 0)]
    configs += [Config("fashion_mnist", 2, start_iter=s) for s in (0, 100, 469)]
    present = [c for c in configs if c.key in groups]
    if len(present) < 2:
        return []
    # Only the seeds every row has, so that rows differ by start_iter alone.
    seeds = set.intersection(*({r["args"]["seed"] for r in groups[c.key]} for c in present))
    lines = [
        f"Seeds {', '.join(map(str, sorted(seeds)))} (those every row has), mean over them.",
        "",
        "| configuration | accuracy after 2 epochs | fewer bytes (2 epochs) "
        "| accuracy after 10 epochs | fewer bytes (10 epochs) | epochs 8-10: mean |",
        "|---|---|---|---|---|---|",
    ]
    for c in present:
        records = [r for r in groups[c.key] if r["args"]["seed"] in seeds]
        row = [c.label]
        for epoch in (2, 10):
            have = [r for r in records if len(r["epochs"]) >= epoch]
            if not have:
                row += ["—", "—"]
                continue
            row.append(f"{statistics.fmean(_value(r, epoch) for r in have):.2f} %")
            row.append(f"{statistics.fmean(_ratio_through(r, epoch) for r in have):.1f}x")
        row.append(f"{_late_mean(records):.2f} %")
        lines.append("| " + " | ".join(row) + " |")
    return lines


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
        plain, mine = _paired(plain, records)
        plain_mean = statistics.fmean(_value(r) for r in plain)
        seeds = "seeds " + ",".join(str(r["args"]["seed"]) for r in mine)
        seeds += " vs plain " + ",".join(str(r["args"]["seed"]) for r in plain)
        alone = [str(r["args"]["seed"]) for r in records if r not in mine]
        if alone:
            seeds += f" (seed {','.join(alone)}: no plain run to compare with yet)"
        fewer = min(r["final"]["ratio"] for r in records)
        if not _finite(records):
            lines.append(f"- {example}, {label}: **missed**, diverged (NaN); {seeds}.")
            continue
        at = _common_epoch(plain, mine)
        plain_mean = statistics.fmean(_value(r, at) for r in plain)
        mean = statistics.fmean(_value(r, at) for r in mine)
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
            if not all(map(_flattened, both)):
                when += " (validation perplexity still falling, so not the flattened result)"
        lines.append(
            f"- {example}, {label}: {verdict} ({want}){when}: "
            f"{delta:+.2f} {unit} vs plain (mean), {fewer:.1f}x fewer bytes; {seeds}."
        )
    return lines


FLAT = 1.0  # % an epoch may still improve validation perplexity, on average, and count as flat
FLAT_EPOCHS = 3  # epochs averaged: one quiet epoch between two LR cuts is not a plateau


def _last_change(record):
    """% change of validation perplexity over the last epoch (NaN after one epoch)."""
    valid = [e["valid_perplexity"] for e in record["epochs"]]
    return 100 * (valid[-1] / valid[-2] - 1) if len(valid) > 1 else float("nan")


def _recent_change(record, last=FLAT_EPOCHS):
    """Mean % change of validation perplexity per epoch over the last `last` epochs.

    Geometric mean of the per-epoch ratios; NaN before `last` + 1 epochs.
    """
    valid = [e["valid_perplexity"] for e in record["epochs"]]
    if len(valid) <= last:
        return float("nan")
    return 100 * ((valid[-1] / valid[-1 - last]) ** (1 / last) - 1)


def _flattened(record):
    change = _recent_change(record)
    return math.isfinite(change) and change > -FLAT


def _lr_cuts(record):
    """Epochs after which the LR went down (each epoch's record holds the next epoch's LR)."""
    lrs = [record["args"]["lr"] * record["world_size"]] + [e["lr"] for e in record["epochs"]]
    return [
        e["epoch"] for e, before, after in zip(record["epochs"], lrs, lrs[1:]) if after < before
    ]


def _percent(change):
    """'+1.2 %', or '—' where there are too few epochs to tell."""
    return f"{change:+.1f} %" if math.isfinite(change) else "—"


def _flattening_table(groups, example="lstm_language_model"):
    """Per run of a language model: where validation perplexity stopped improving, LR cuts.

    The transformer's LR follows a cosine, which falls every epoch: its column says so.
    """
    lines = [
        "| configuration | seed | epochs | best valid perplexity (epoch) | test perplexity there "
        f"| last epoch vs the one before | last {FLAT_EPOCHS} epochs, per epoch "
        "| LR cut after epochs | flattened |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key in _ordered(groups):
        for r in groups[key]:
            if r["example"] != example:
                continue
            epochs = r["epochs"]
            valid = [e["valid_perplexity"] for e in epochs]
            best = min(range(len(valid)), key=valid.__getitem__)
            if example == "transformer_lm":
                cuts = [f"cosine over {r['args']['decay_epochs']} epochs"]
            else:
                cuts = _lr_cuts(r)
            lines.append(
                f"| {_config(groups[key]).label} | {r['args']['seed']} | {len(epochs)} "
                f"| {valid[best]:.1f} ({epochs[best]['epoch']}) | {_value(r, best + 1):.2f} "
                f"| {_percent(_last_change(r))} | {_percent(_recent_change(r))} "
                f"| {', '.join(map(str, cuts)) or '—'} | {'yes' if _flattened(r) else 'no'} |"
            )
    return lines if len(lines) > 2 else []


def _gap_by_epoch_table(groups, example="lstm_language_model"):
    """A language model's test perplexity by epoch, seed means, each against plain's seeds.

    Shows whether a gap to plain is closing or steady as the curves flatten, which a verdict
    read at one epoch cannot.
    """
    plain = groups.get(Config(example, 0).key)
    others = [
        k
        for k in _ordered(groups)
        if groups[k][0]["example"] == example and _config(groups[k]).rank
    ]
    if not plain or not others:
        return []
    columns = [(_config(groups[k]).label, groups[k], _paired(plain, groups[k])) for k in others]
    last = min(len(r["epochs"]) for r in [*plain, *(r for k in others for r in groups[k])])
    head = f"| epoch | {_config(plain).label} |" + "".join(f" {c[0]} | vs plain |" for c in columns)
    lines = [head, "|---|---|" + "---|---|" * len(columns)]
    for epoch in range(1, last + 1):
        row = [str(epoch), f"{statistics.fmean(_value(r, epoch) for r in plain):.2f}"]
        for _, records, (same, mine) in columns:
            mean = statistics.fmean(_value(r, epoch) for r in records)
            paired = statistics.fmean(_value(r, epoch) for r in mine)
            base = statistics.fmean(_value(r, epoch) for r in same)
            row += [f"{mean:.2f}", _delta(example, paired, base)]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _per_epoch_table(example, groups):
    key = EXAMPLES[example][1]
    extra = example in LANGUAGE_MODELS
    head = "| configuration | seed | epoch | " + EXAMPLES[example][2]
    head += " | valid perplexity | lr" if extra else ""
    lines = [head + " | train loss | train time |", "|---" * (8 if extra else 6) + "|"]
    for k in sorted(groups):
        for r in groups[k]:
            if r["example"] != example:
                continue
            for e in r["epochs"]:
                cells = [_config(groups[k]).label, str(r["args"]["seed"]), str(e["epoch"])]
                cells.append(f"{_scale(example) * e[key]:.2f}")
                if extra:
                    cells += [f"{e['valid_perplexity']:.1f}", f"{e['lr']:g}"]
                cells += [f"{e['train_loss']:.4f}", f"{e['train_time_s']:.0f} s"]
                lines.append("| " + " | ".join(cells) + " |")
    return lines


def _retrained_lines(groups, example):
    """Runs trained again from epoch 1 because their checkpoint was on another machine:
    how closely the new run repeats the epochs the earlier one recorded."""
    key = EXAMPLES[example][1]
    lines = []
    for k in _ordered(groups):
        for r in groups[k]:
            if r["example"] != example:
                continue
            for old in r.get("replaced_runs", []):
                n = min(len(old["epochs"]), len(r["epochs"]))
                if not n:
                    continue
                diffs = [
                    100 * abs(r["epochs"][i][key] / old["epochs"][i][key] - 1) for i in range(n)
                ]
                worst = max(range(n), key=diffs.__getitem__)
                same = all(r["epochs"][i][key] == old["epochs"][i][key] for i in range(n))
                started = old["launch"].get("started_utc", "?")
                first = (old.get("earlier_launches") or [old["launch"]])[0]
                lines.append(
                    f"- {_config(groups[k]).label}, seed {r['args']['seed']}: trained again "
                    f"from epoch 1 (the earlier run, first launched "
                    f"{first.get('started_utc', started)} UTC, had {len(old['epochs'])} epochs "
                    f"and its checkpoint was on another machine). Over epochs 1-{n} its "
                    f"{EXAMPLES[example][2]} "
                    + (
                        "is bitwise the same."
                        if same
                        else f"differs by at most {diffs[worst]:.2f} % (epoch {worst + 1}: "
                        f"{_scale(example) * old['epochs'][worst][key]:.2f} then, "
                        f"{_value(r, worst + 1):.2f} now)."
                    )
                    + _machines_then_and_now(old["launch"], r["launch"])
                )
    return lines


def _machines_then_and_now(then, now):
    """' Then on A, now on B.' where the two launches' machines differ (or one is unknown)."""
    unknown = "a machine not recorded"
    a, b = then.get("machine"), now.get("machine")
    return "" if a == b else f" Then on {a or unknown}, now on {b or unknown}."


def _machines_lines(groups, example):
    """Which machine each run trained on, where the runs of `example` were not all on one."""
    runs = [r for k in _ordered(groups) for r in groups[k] if r["example"] == example]
    where = [r["launch"].get("machine") or "not recorded" for r in runs]
    if len(set(where)) < 2:
        return []
    lines = [
        "These runs trained on more than one machine. Epoch times compare only runs of one",
        "machine, and a run repeated on another CPU does not repeat bitwise (other kernels,",
        "other summation order): read such differences as noise, like another seed's.",
        "",
    ]
    for r, m in zip(runs, where):
        lines.append(f"- {r['config']['label']}, seed {r['args']['seed']}: {m}")
    return lines


LR_NOTES = {
    "lstm_language_model": '"LR cut after epochs" is read from each run\'s record: the '
    "campaign cuts the LR by 4 at the same epochs in every run (`--lm-lr-drop-after`).",
    "transformer_lm": "Every run follows the same warm-up and cosine (`--tf-decay-epochs`), "
    "so the LR falls every epoch, alike in every run.",
}


def write_report(groups, out_dir):
    every, (groups, behind) = groups, _current(groups)
    plots = write_plots(groups, out_dir)
    lines = [
        "# Convergence: plain Horovod vs PowerSGD, both schedules, several seeds",
        "",
        "Written by `scripts/convergence.py` (`make convergence`) from the per-run JSON files",
        "in [`convergence/`](convergence/); every number below was measured by that script.",
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
        lines += [*_summary_table(example, mine), ""]
        held = _behind_lines(groups, behind, example)
        lines += [*held, ""] if held else []
        flat = _flattening_table(runs, example) if example in LANGUAGE_MODELS else []
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
        gap = _gap_by_epoch_table(mine, example) if example in LANGUAGE_MODELS else []
        if gap:
            lines += [
                "### Test perplexity epoch by epoch: is the gap to plain closing?",
                "",
                "Mean over seeds; each configuration against plain over the seeds both have.",
                "",
                *gap,
                "",
            ]
        again = _retrained_lines(runs, example)
        if again:
            lines += ["### Runs trained again", "", *again, ""]
        machines = _machines_lines(runs, example)
        if machines:
            lines += ["### Machines", "", *machines, ""]
        if example == "fashion_mnist":
            warm = _warmup_table(mine)
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
        lines += _per_epoch_table(example, runs)
        lines += ["", "</details>", ""]
    with open(os.path.join(out_dir, "convergence.md"), "w") as f:
        f.write("\n".join(lines))


def main(argv=None):
    args = parse_args(argv)
    runs_dir = os.path.join(args.out, "convergence")
    os.makedirs(runs_dir, exist_ok=True)
    if not args.report_only:
        for name, config, _seed, run_argv in run_plan(args):
            if _past(args.deadline):
                print(f"[convergence] deadline {args.deadline} UTC passed; stopping", flush=True)
                break
            run_one(name, config, run_argv, args, runs_dir)
            write_report(load_runs(runs_dir), args.out)
    write_report(load_runs(runs_dir), args.out)
    print(f"[convergence] report: {os.path.join(args.out, 'convergence.md')}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
