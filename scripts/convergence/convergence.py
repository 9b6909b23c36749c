"""Convergence campaign: plain Horovod vs PowerSGD, both schedules, several seeds.

    python scripts/convergence/convergence.py                          # the four parts (many hours)
    python scripts/convergence/convergence.py --parts auto --auto-link 38mbit,1.5ms  # rank="auto"
    python scripts/convergence/convergence.py --parts transformer     # the transformer (11 hours)
    python scripts/convergence/convergence.py --parts fashion,warmup  # Fashion-MNIST only
    python scripts/convergence/convergence.py --deadline 09:40        # no run after 09:40 UTC
    python scripts/convergence/convergence.py --parts transformer --only transformer_lm-plain
    python scripts/convergence/convergence.py --parts lstm --lm-epochs 24  # train the LSTM runs on
    python scripts/convergence/convergence.py --report-only            # rebuild the report

How the campaign is run, and why: docs/results/convergence-notes.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

from convergence_report import load_runs, write_report
from convergence_runs import (
    EXAMPLES,
    MPI_ARGS,
    ROOT,
    TRANSFORMER_WARMUP,
    Config,
    lr_cuts,
    machine,
)

VENV_BIN = os.path.join(ROOT, ".venv", "bin")
FASHION_STEPS_PER_EPOCH = 469  # 60,000 images / (2 workers x 64)
TRANSFORMER_RANKS = (4, 16)
# The "auto" part plans for the link that make bench-auto measured at its 50 Mbit/s cap
# (docs/benchmarks-auto.md: each auto record's link).
AUTO_LINK = "50mbit"
CHECKPOINTS = os.path.join("runs", "convergence")  # from ROOT; ignored by git (tens of MB)
PARTS = ("fashion", "warmup", "lstm", "transformer", "auto")
DEFAULT_PARTS = PARTS[:4]  # "auto" (rank="auto" with a slow link's plan) runs when asked
LSTM = "lstm_language_model"


def parse_args(argv=None):
    """The campaign's flags, from `argv` (default: the command line)."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--np", type=int, default=2, help="workers per run")
    p.add_argument(
        "--parts",
        default=",".join(DEFAULT_PARTS),
        help="any of " + ", ".join(PARTS) + ", comma-separated",
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
    p.add_argument(
        "--auto-link",
        default=AUTO_LINK,
        help='the "auto" part: the link rank="auto" plans for (its choices on a slow link, '
        "trained here without the cap)",
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
    auto = [Config(e, "auto", link=args.auto_link) for e in ("fashion_mnist", LSTM)]
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
    if "auto" in parts:
        order += [(auto[0], s) for s in seeds] + [(auto[1], s) for s in lm_seeds]

    plan = []
    for config, seed in order:
        name = f"{config.key}-s{seed}"
        argv = ["--seed", str(seed), "--no-progress", "--powersgd-rank", str(config.rank)]
        argv += ["--rounds", str(config.rounds), "--start-iter", str(config.start_iter)]
        if config.link:
            argv += ["--powersgd-link", config.link]
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
    """Launches one run of the plan unless its record says it is done, then completes the record.

    A run with a complete record is skipped. One with fewer epochs goes on from its
    checkpoint, or trains again from epoch 1 where the checkpoint is not on this machine.
    One whose LR was cut after other epochs than `argv` asks is not run.

    Args:
        name: the run's file name without extension, `{config.key}-s{seed}`.
        config: the run's configuration.
        argv: the example's flags, as `run_plan` gives them.
        args: the campaign's flags (`--np`, `--rerun`).
        runs_dir: the folder of the runs' JSON records and logs.
    """
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
            cuts = [c for c in lr_cuts(old) if c < done]
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


def main(argv=None):
    """Runs the plan (none of it with `--report-only`), rebuilding the report after each run."""
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
