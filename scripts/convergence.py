"""Plain Horovod vs PowerSGD ranks 1, 2, 4 on both examples (what `make convergence` runs).

Every run uses 2 workers launched with horovodrun, the same seed and the same
hyper-parameters; only ``--powersgd-rank`` differs. Each run writes its
per-epoch JSON under docs/results/convergence/, and after every run this script
rewrites docs/results/convergence.md and the PNG plots from all the JSON files
there, so an interrupted campaign still documents what finished.

    python scripts/convergence.py                      # everything (hours on 2 cores)
    python scripts/convergence.py --only fashion_mnist --ranks 0,2 --cnn-epochs 1
    python scripts/convergence.py --report-only        # rebuild the report from the JSON files
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_BIN = os.path.join(ROOT, ".venv", "bin")

EXAMPLES = {
    # name: (script, metric key in "final"/"epochs", label, higher is better)
    "fashion_mnist": ("examples/fashion_mnist.py", "test_accuracy", "test accuracy", True),
    "lstm_language_model": (
        "examples/lstm_language_model.py",
        "test_perplexity",
        "test perplexity",
        False,
    ),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--np", type=int, default=2, help="workers per run")
    p.add_argument("--ranks", default="0,2,4,1", help="PowerSGD ranks, 0 = plain Horovod")
    p.add_argument(
        "--only", default=None, help="run one example (fashion_mnist or lstm_language_model)"
    )
    p.add_argument("--cnn-epochs", type=int, default=2, help="Fashion-MNIST epochs")
    p.add_argument("--lm-epochs", type=int, default=2, help="LSTM epochs")
    p.add_argument(
        "--lm-train-tokens", type=int, default=200000, help="LSTM training tokens; 0 = all"
    )
    p.add_argument("--lm-eval-tokens", type=int, default=30000, help="LSTM eval tokens; 0 = all")
    p.add_argument("--seed", type=int, default=42, help="the same seed for every run")
    p.add_argument(
        "--extra",
        default="",
        help="more flags for every run, e.g. '--max-steps 3' for a smoke test",
    )
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "results"), help="report folder")
    p.add_argument("--rerun", action="store_true", help="rerun runs that already finished")
    p.add_argument("--report-only", action="store_true", help="only rebuild the report")
    return p.parse_args(argv)


def run_plan(args):
    """(name, example, argv) of every run, ordered so the headline pairs come first."""
    ranks = [int(r) for r in args.ranks.split(",")]
    common = ["--seed", str(args.seed), "--no-progress", *shlex.split(args.extra)]
    per_example = {
        "fashion_mnist": [*common, "--epochs", str(args.cnn_epochs)],
        "lstm_language_model": [
            *common,
            "--epochs",
            str(args.lm_epochs),
            "--train-subset",
            str(args.lm_train_tokens),
            "--eval-subset",
            str(args.lm_eval_tokens),
        ],
    }
    # Headline comparisons first (CNN plain vs rank 2, LSTM plain vs rank 4), the rest after,
    # so a campaign cut short still answers the main question.
    order = [("fashion_mnist", 0), ("fashion_mnist", 2), ("lstm_language_model", 0)]
    order += [("lstm_language_model", 4)]
    order += [(e, r) for e in EXAMPLES for r in ranks if (e, r) not in order]
    plan = []
    for example, rank in order:
        if rank not in ranks or (args.only and example != args.only):
            continue
        plan.append(
            (
                f"{example}-rank{rank}",
                example,
                [*per_example[example], "--powersgd-rank", str(rank)],
            )
        )
    return plan


def run_one(name, example, argv, args, runs_dir):
    json_path = os.path.join(runs_dir, f"{name}.json")
    log_path = os.path.join(runs_dir, f"{name}.log")
    if os.path.exists(json_path) and not args.rerun:
        with open(json_path) as f:
            if "final" in json.load(f):
                print(f"[convergence] {name}: already done, skipping", flush=True)
                return
    script = EXAMPLES[example][0]
    command = [
        os.path.join(VENV_BIN, "horovodrun"), "-np", str(args.np), "-H", f"localhost:{args.np}",
        os.path.join(VENV_BIN, "python"), script, *argv, "--json", os.path.relpath(json_path, ROOT),
    ]  # fmt: skip
    shown = " ".join(
        shlex.quote(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c) for c in command
    )
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    print(f"[convergence] {name}: {shown}", flush=True)
    load_before = os.getloadavg()
    start = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.time() - start
    if proc.returncode != 0:
        print(f"[convergence] {name}: FAILED (exit {proc.returncode}), see {log_path}", flush=True)
        return
    with open(json_path) as f:
        record = json.load(f)
    record["launch"] = {
        "command": f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']} {shown}",
        "wall_s": wall,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(start)),
    }
    with open(json_path, "w") as f:
        json.dump(record, f, indent=2)
    print(f"[convergence] {name}: done in {wall:.0f} s", flush=True)


def load_runs(runs_dir):
    runs = {}
    for name in sorted(os.listdir(runs_dir)) if os.path.isdir(runs_dir) else []:
        if name.endswith(".json"):
            with open(os.path.join(runs_dir, name)) as f:
                record = json.load(f)
            if "final" in record and "launch" in record:
                runs[name[: -len(".json")]] = record
    return runs


def _rank(record):
    return record["args"]["powersgd_rank"]


def _fmt_metric(example, value):
    return f"{100 * value:.2f} %" if example == "fashion_mnist" else f"{value:.1f}"


def write_plots(runs, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {}
    for example, (_script, key, label, _higher) in EXAMPLES.items():
        records = sorted(
            (r for r in runs.values() if r["example"] == example), key=lambda r: _rank(r)
        )
        if not records:
            continue
        fig, (by_epoch, by_bytes) = plt.subplots(1, 2, figsize=(11, 4))
        for r in records:
            name = f"PowerSGD rank {_rank(r)}" if _rank(r) else "plain Horovod"
            epochs = [e["epoch"] for e in r["epochs"]]
            values = [e[key] * (100 if example == "fashion_mnist" else 1) for e in r["epochs"]]
            sent, total = [], 0
            for e in r["epochs"]:
                total += e["bytes_sent"]
                sent.append(total / 1e6)
            by_epoch.plot(epochs, values, marker="o", label=name)
            by_bytes.plot(sent, values, marker="o", label=name)
        unit = " (%)" if example == "fashion_mnist" else ""
        by_epoch.set(xlabel="epoch", ylabel=label + unit, title=f"{example}: {label} per epoch")
        by_bytes.set(
            xlabel="MB sent per worker (cumulative, log scale)",
            ylabel=label + unit,
            title=f"{example}: {label} vs bytes sent",
            xscale="log",
        )
        by_epoch.xaxis.get_major_locator().set_params(integer=True)
        for ax in (by_epoch, by_bytes):
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        path = os.path.join(out_dir, f"convergence_{example}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths[example] = os.path.basename(path)
    return paths


def write_report(runs, out_dir):
    plots = write_plots(runs, out_dir)
    lines = [
        "# Convergence: plain Horovod vs PowerSGD",
        "",
        "Written by `scripts/convergence.py` (`make convergence`) from the per-run JSON files in",
        "[`convergence/`](convergence/); every number below was measured by that script. Each run:",
        "2 workers on one 2-core machine (`horovodrun -np 2 -H localhost:2`), the same seed and",
        "hyper-parameters, only `--powersgd-rank` differs (0 = plain `hvd.DistributedOptimizer`).",
        "Bytes are per worker, as counted by `compression_stats()` (plain: every gradient once per",
        "step at float32). Wall times come from a shared machine whose load average is listed;",
        "they measure this machine's contention, not PowerSGD's speed (the benchmark does that).",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}.",
        "",
    ]
    notes = os.path.join(out_dir, "convergence-notes.md")
    if os.path.exists(notes):
        with open(notes) as f:
            lines += [f.read().rstrip(), ""]
    for example, (_script, key, label, _higher) in EXAMPLES.items():
        records = sorted(
            (r for r in runs.values() if r["example"] == example), key=lambda r: _rank(r)
        )
        lines += [f"## {example}", ""]
        if not records:
            lines += ["Not run yet.", ""]
            continue
        plain = next((r for r in records if _rank(r) == 0), None)
        lines += [
            f"| method | epochs | final {label} | vs plain | bytes / epoch / worker | ratio "
            "| wall time | load avg (1 min, start/end) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in records:
            final = r["final"][key]
            if plain is None or r is plain:
                delta = "—"
            elif example == "fashion_mnist":
                delta = f"{100 * (final - plain['final'][key]):+.2f} pp"
            else:
                delta = f"{100 * (final / plain['final'][key] - 1):+.1f} %"
            per_epoch = r["final"]["bytes_sent"] / len(r["epochs"])
            load = r["launch"]["loadavg_before"][0], r["launch"]["loadavg_after"][0]
            name = f"PowerSGD rank {_rank(r)}" if _rank(r) else "plain Horovod"
            lines.append(
                f"| {name} | {len(r['epochs'])} | {_fmt_metric(example, final)} | {delta} "
                f"| {per_epoch / 1e6:.1f} MB | {r['final']['ratio']:.1f}x "
                f"| {r['launch']['wall_s'] / 60:.1f} min | {load[0]:.1f} / {load[1]:.1f} |"
            )
        lines += ["", "Per epoch:", ""]
        lines += [f"| method | epoch | {label} | bytes sent | ratio | wall time |"]
        lines += ["|---|---|---|---|---|---|"]
        for r in records:
            name = f"rank {_rank(r)}" if _rank(r) else "plain"
            for e in r["epochs"]:
                lines.append(
                    f"| {name} | {e['epoch']} | {_fmt_metric(example, e[key])} "
                    f"| {e['bytes_sent'] / 1e6:.1f} MB | {e['ratio']:.1f}x "
                    f"| {e['wall_time_s']:.0f} s |"
                )
        if example in plots:
            lines += ["", f"![{example}]({plots[example]})"]
        lines += ["", "Commands (from the repository root):", "", "```"]
        lines += [r["launch"]["command"] for r in records]
        lines += ["```", ""]
    with open(os.path.join(out_dir, "convergence.md"), "w") as f:
        f.write("\n".join(lines))


def main(argv=None):
    args = parse_args(argv)
    runs_dir = os.path.join(args.out, "convergence")
    os.makedirs(runs_dir, exist_ok=True)
    if not args.report_only:
        for name, example, run_argv in run_plan(args):
            run_one(name, example, run_argv, args, runs_dir)
            write_report(load_runs(runs_dir), args.out)
    write_report(load_runs(runs_dir), args.out)
    print(f"[convergence] report: {os.path.join(args.out, 'convergence.md')}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
