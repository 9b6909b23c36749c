"""Driver of the benchmark: launch every configuration's workers, one after another.

Examples::

    # everything, 2 workers, ResNet-18, unlimited + two capped links; table on stdout
    python -m horovod_powersgd.bench -np 2 --bandwidth unlimited,1gbit,200mbit \\
        --json bench.json --plot bench.png
    # a quick look at two configurations
    python -m horovod_powersgd.bench --configs horovod,powersgd:2 --steps 5
    # paired: every configuration in one job per link, ratios with 95 % intervals, stop when
    # the targets' intervals are within +-1 % or after 15 minutes
    python -m horovod_powersgd.bench --paired --models gpt --bandwidth unlimited,50mbit \\
        --configs local,horovod,horovod-fp16,powersgd:2,powersgd-auto --budget-s 900

Configurations (``--configs``, comma separated; ``NAME:R`` picks a PowerSGD rank):
  local          each worker trains alone, no communication (the lower bound)
  horovod        hvd.DistributedOptimizer, plain fp32 all-reduce
  horovod-fp16   the same with hvd.Compression.fp16
  powersgd       horovod_powersgd.DistributedOptimizer at every rank of --ranks
  powersgd-fp16  the same with comm_dtype=torch.float16 (rank --compare-rank)
  powersgd-1round, powersgd-1round-fp16
                 the same with rounds=1, the alternating one-round step (rank --compare-rank)
  powersgd-nostats
                 powersgd with layer_stats=False (rank --compare-rank): beside powersgd,
                 the cost of the per-layer statistics and the early warning
  powersgd-none  the library with nothing compressed (min_compression_rate=1e12): beside
                 horovod, the fixed cost it adds to a step
  powersgd-hier  hierarchical=True at every rank of --ranks: exact in the node, compressed
                 between nodes (a job of several nodes, e.g. under scripts/nodes/two_nodes.sh)
  powersgd-auto, powersgd-1round-auto
                 rank="auto", both schedules (warm-up: until its tuner settles, >= 40 steps)
  powersgd-hier-auto
                 rank="auto" with hierarchical="auto": auto chooses flat or hierarchical too
  powersgd-qbyq  powersgd (rounds=2, flat) with each bucket's Q sent alone as its P comes
                 back, the order before 5a4e37f (bench/ablation.py): beside powersgd, what
                 sending every Q in one grouped all-reduce changes
  horovod-slowed (--paired only) plain Horovod that sleeps --slowdown of its own step: the
                 proof that a paired job measures a slowdown of that size
  ddp            torch DistributedDataParallel over Gloo, plain all-reduce
  ddp-powersgd   DDP + torch's powerSGD_hook (rank --compare-rank), same start_iter
                 and min_compression_rate as powersgd
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from . import confidence, report, targets
from .configs import CONFIGS, DDP_CONFIGS, HOROVOD_CONFIGS, RANKED
from .models import MODELS
from .netcap import (
    BandwidthCapError,
    check_namespace_support,
    format_bandwidth,
    parse_bandwidth,
    tc_commands,
)
from .paired import PAIRED_CONFIGS, PROGRESS, describe_plan
from .stats import Record, make_record

KNOWN = tuple(dict.fromkeys((*CONFIGS, *PAIRED_CONFIGS)))
DEFAULT_CONFIGS = "local,horovod,horovod-fp16,powersgd,powersgd-fp16,ddp,ddp-powersgd"


def parse_configs(
    text: str, ranks: Sequence[int], compare_rank: int
) -> list[tuple[str, int | None]]:
    """``"local,powersgd,ddp-powersgd:4"`` -> [(name, PowerSGD rank or None), ...].

    Example:
        >>> parse_configs("local,powersgd,ddp-powersgd:4", [1, 2], 2)
        [('local', None), ('powersgd', 1), ('powersgd', 2), ('ddp-powersgd', 4)]
    """
    plan: list[tuple[str, int | None]] = []
    for token in filter(None, (t.strip() for t in text.split(","))):
        name, _, rank_text = token.partition(":")
        if name not in KNOWN:
            raise ValueError(f"unknown configuration {name!r}; choose from {', '.join(KNOWN)}")
        if rank_text:
            if name not in RANKED:
                raise ValueError(f"{name} has no PowerSGD rank; drop ':{rank_text}'")
            if not rank_text.isdigit() or int(rank_text) < 1:
                raise ValueError(f"rank in {token!r} must be an integer >= 1")
            plan.append((name, int(rank_text)))
        elif name == "powersgd":
            plan.extend((name, r) for r in ranks)
        elif name in RANKED:
            plan.append((name, compare_rank))
        else:
            plan.append((name, None))
    if not plan:
        raise ValueError("no configuration selected")
    return plan


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_env(settings: dict) -> dict[str, str]:
    env = dict(os.environ)
    threads = str(settings["threads"])
    env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, PYTHONUNBUFFERED="1")
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if settings.get("cycle_time_ms") is not None:
        env["HOROVOD_CYCLE_TIME"] = str(settings["cycle_time_ms"])
    if settings.get("fusion_threshold_mb") is not None:
        env["HOROVOD_FUSION_THRESHOLD"] = str(int(settings["fusion_threshold_mb"] * 2**20))
    # Everything talks over the loopback: the only interface in a capped namespace.
    env.update(GLOO_SOCKET_IFNAME="lo", HOROVOD_GLOO_IFACE="lo")
    return env


def horovod_launcher(settings: dict, env: dict[str, str]) -> list[str]:
    """``mpirun ...`` or ``horovodrun --gloo ...`` for ``settings["np"]`` ranks on this host."""
    np_ = settings["np"]
    if settings["controller"] == "mpi":
        # btl tcp,self: shared memory (vader) would bypass the bandwidth cap.
        argv = [
            "mpirun",
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            str(np_),
            "--bind-to",
            "none",
            "--map-by",
            "slot",
            "--mca",
            "btl",
            "tcp,self",
            "--mca",
            "btl_tcp_if_include",
            "lo",
            "--mca",
            "oob_tcp_if_include",
            "lo",
            # Waiting ranks yield the core instead of busy-polling it: with every
            # core already running a worker, a spinning wait slows the others.
            "--mca",
            "mpi_yield_when_idle",
            "1",
        ]
        for var in (
            "OMP_NUM_THREADS",
            "MKL_NUM_THREADS",
            "PYTHONUNBUFFERED",
            "PATH",
            "HOROVOD_CYCLE_TIME",
            "HOROVOD_FUSION_THRESHOLD",
            "HOROVOD_POWERSGD_PROFILE",  # rank="auto" writes its measurements (bench.scale)
            "PYTHONPATH",
        ):
            if var in env:
                argv += ["-x", var]
        return argv
    horovodrun = shutil.which("horovodrun", path=str(Path(sys.executable).parent))
    return [
        horovodrun or "horovodrun",
        "-np",
        str(np_),
        "-H",
        f"localhost:{np_}",
        "--gloo",
        "--network-interface",
        "lo",
    ]


def launch_commands(
    config: str, rank: int | None, model: str, settings: dict, out_dir: Path
) -> list[tuple[list[str], dict[str, str]]]:
    """The processes to start for one configuration: (argv, environment) pairs."""
    np_ = settings["np"]
    worker = [
        sys.executable,
        "-m",
        "horovod_powersgd.bench.worker",
        "--config",
        config,
        "--model",
        model,
        "--rank",
        str(rank or 1),
        "--batch-size",
        str(settings["batch_size"]),
        "--warmup-steps",
        str(settings["warmup_steps"]),
        "--steps",
        str(settings["steps"]),
        "--start-iter",
        str(settings["start_iter"]),
        "--min-compression-rate",
        str(settings["min_compression_rate"]),
        "--threads",
        str(settings["threads"]),
        "--out-dir",
        str(out_dir),
    ]
    env = _worker_env(settings)
    if config in HOROVOD_CONFIGS:
        return [(horovod_launcher(settings, env) + worker, env)]
    procs = []
    port = str(_free_port())
    for r in range(np_):
        penv = dict(env, BENCH_RANK=str(r))
        if config in DDP_CONFIGS:
            penv.update(
                RANK=str(r),
                LOCAL_RANK=str(r),
                WORLD_SIZE=str(np_),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
            )
        procs.append((worker, penv))
    return procs


def run_config(config: str, rank: int | None, model: str, settings: dict, bandwidth: str):
    """Run one configuration once; its per-worker reports, or None if it failed."""
    with tempfile.TemporaryDirectory(prefix="hps-bench-") as tmp:
        out_dir = Path(tmp)
        started = [
            subprocess.Popen(
                argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            for argv, env in launch_commands(config, rank, model, settings, out_dir)
        ]
        deadline = time.monotonic() + settings["timeout_s"]
        logs, failed = [], False
        for proc in started:
            try:
                out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
                out += f"\n[bench] killed after {settings['timeout_s']} s"
            logs.append(out)
            failed |= proc.returncode != 0
        reports = [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]
        if failed or len(reports) != settings["np"]:
            tail = "\n".join(log[-3000:] for log in logs)
            print(f"[bench] {config} (rank {rank}) at {bandwidth} FAILED:\n{tail}", file=sys.stderr)
            return None
    phases = reports[0]["phase_median_ms"]
    print(
        " [rank 0 median: " + ", ".join(f"{k} {v:.0f}" for k, v in phases.items()) + " ms]",
        end="",
        file=sys.stderr,
    )
    return reports


def pool_runs(
    config: str, rank: int | None, model: str, np_: int, bandwidth: str, runs: list[list[dict]]
) -> Record:
    """One Record from the worker reports of one or more runs of a configuration.

    Worker w's step times of every run are concatenated, so a step is still
    timed as the slowest worker of that step, and the median pools all runs.
    """
    workers = range(len(runs[0]))
    last = runs[-1]
    plain_bytes = 4.0 * max(r["elements_uncompressed_per_step"] for r in last)
    return make_record(
        config=config,
        model=model,
        rank=rank,
        np=np_,
        bandwidth=bandwidth,
        step_times_s=[[t for run in runs for t in run[w]["step_times_s"]] for w in workers],
        elements_per_step=max(r["elements_per_step"] for r in last),
        bytes_per_step=max(r["bytes_per_step"] for r in last),
        plain_bytes_per_step=0.0 if config == "local" else plain_bytes,
        peak_rss_mb=[r["peak_rss_mb"] for run in runs for r in run],
        detail=_auto_detail(last),
    )


def _auto_detail(reports) -> str:
    """rank="auto": each run's plan (bucket by bucket, 0 = plain) and the link it measured."""
    report = reports[0]
    if "plan" not in report:
        return ""
    link = report["link"]
    return describe_plan(report["plan"], link["mbit_s"] / 8e-6, link["latency_ms"] / 1e3)


def run_order(plan: Sequence, rounds: int) -> list:
    """The order of runs over ``rounds`` rounds: forward, backward, forward, ...

    Reversing every other round puts each configuration's runs symmetrically
    around the middle of the session, so a slow drift of the machine's speed
    shifts all configurations alike instead of favouring the first ones.

    Example:
        >>> run_order(["a", "b", "c"], 3)
        ['a', 'b', 'c', 'c', 'b', 'a', 'a', 'b', 'c']
    """
    order = []
    for i in range(rounds):
        order += list(plan) if i % 2 == 0 else list(reversed(plan))
    return order


def run_suite(settings: dict, bandwidth: str) -> list[Record]:
    """Every model x configuration at one bandwidth, in the current network namespace."""
    records = []
    if settings.get("paired"):
        for model in settings["models"]:
            records += run_paired(settings, model, bandwidth)
        return records
    rounds = settings.get("repeat", 1)
    for model in settings["models"]:
        runs: dict[tuple, list] = {tuple(entry): [] for entry in settings["plan"]}
        failed = set()
        for config, rank in run_order([tuple(e) for e in settings["plan"]], rounds):
            if (config, rank) in failed:
                continue
            label = f"{config}" + (f" r{rank}" if rank else "")
            print(
                f"[bench] {bandwidth:>9} {model:8} {label:18} ...",
                end="",
                file=sys.stderr,
                flush=True,
            )
            t0 = time.monotonic()
            reports = run_config(config, rank, model, settings, bandwidth)
            if reports is None:
                failed.add((config, rank))
                status = "failed"
            else:
                runs[(config, rank)].append(reports)
                one = pool_runs(config, rank, model, settings["np"], bandwidth, [reports])
                status = f"{one.median_step_ms:8.0f} ms/step"
            print(f" {status} ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
        for (config, rank), done in runs.items():
            if (config, rank) not in failed:
                pooled = pool_runs(config, rank, model, settings["np"], bandwidth, done)
                records.append(dataclasses.replace(pooled, settings=recorded_settings(settings)))
    return records


# What the report says about how a job ran, kept with its records (--from-json renders it).
NOT_RECORDED = ("models", "plan", "timeout_s", "bandwidth")


def recorded_settings(settings: dict) -> dict:
    return {k: v for k, v in settings.items() if k not in NOT_RECORDED}


def paired_command(model: str, settings: dict, bandwidth: str, out_dir: Path):
    """The launcher line of one paired job (every configuration that can share a process)."""
    plan = [[c, r] for c, r in settings["plan"] if c not in DDP_CONFIGS]
    env = _worker_env(settings)
    job = [
        sys.executable,
        "-m",
        "horovod_powersgd.bench.paired",
        "--model",
        model,
        "--plan",
        json.dumps(plan),
        "--bandwidth",
        bandwidth,
        "--out-dir",
        str(out_dir),
    ]
    for key in (
        "batch_size",
        "warmup_steps",
        "block_steps",
        "min_rounds",
        "max_rounds",
        "budget_s",
        "slowdown",
        "start_iter",
        "min_compression_rate",
        "threads",
    ):
        job += ["--" + key.replace("_", "-"), str(settings[key])]
    return horovod_launcher(settings, env) + job, env  # fmt: skip


def run_watched(argv, env, progress: Path, idle_s: float, poll_s: float = 5.0):
    """Run a paired job to its end, or kill it once `progress` (a file it touches after
    every step) has been left alone for `idle_s` seconds, counting from the start: a job
    that stalls ends, one that goes on runs as long as its warm-up and budget take.
    Returns (failed, its output)."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        last = time.time()
        while proc.poll() is None:
            time.sleep(min(poll_s, idle_s))
            if progress.exists():
                last = max(last, progress.stat().st_mtime)
            if time.time() - last > idle_s:
                os.killpg(proc.pid, signal.SIGKILL)  # mpirun and the ranks it started here
                proc.wait()
                out.write(f"\n[bench] killed: no step for {idle_s:.0f} s")
                break
        out.seek(0)
        return proc.returncode != 0, out.read()


def run_paired(settings: dict, model: str, bandwidth: str) -> list[Record]:
    """One paired job for ``model`` at ``bandwidth``; then the DDP ones, a job each."""
    print(f"[bench] {bandwidth:>9} {model:8} paired job ...", file=sys.stderr, flush=True)
    records: list[Record] = []
    with tempfile.TemporaryDirectory(prefix="hps-bench-") as tmp:
        argv, env = paired_command(model, settings, bandwidth, Path(tmp))
        failed, log = run_watched(argv, env, Path(tmp) / PROGRESS, settings["timeout_s"])
        out = Path(tmp) / "paired.json"
        if failed or not out.exists():
            print(f"[bench] paired job FAILED:\n{log[-3000:]}", file=sys.stderr)
        else:
            outcome = json.loads(out.read_text())
            job = dict(recorded_settings(settings), paired=True, stopped=outcome["stopped"],
                       rounds=outcome["rounds"], seconds=round(outcome["seconds"]),
                       warmup_s=round(outcome["warmup_s"]),
                       pause_taken_over_asked=outcome["pause_taken_over_asked"])  # fmt: skip
            for r in outcome["records"]:
                records.append(Record(**dict(r, settings=dict(job, **r["settings"]))))
            print(f"[bench] stopped ({outcome['stopped']}) after {outcome['rounds']} rounds, "
                  f"{outcome['seconds']:.0f} s", file=sys.stderr)  # fmt: skip
    separate = dict(recorded_settings(settings), paired=False)
    for config, rank in settings["plan"]:
        if config in DDP_CONFIGS:  # cannot share a process with Horovod: a job of its own
            print(f"[bench] {bandwidth:>9} {model:8} {config} r{rank}, a job of its own ...",
                  end="", file=sys.stderr, flush=True)  # fmt: skip
            reports = run_config(config, rank, model, settings, bandwidth)
            print(file=sys.stderr)
            if reports is not None:
                one = pool_runs(config, rank, model, settings["np"], bandwidth, [reports])
                records.append(dataclasses.replace(one, settings=separate))
    return records


def run_capped(settings: dict, bandwidth: str) -> list[Record]:
    """Run the suite in a fresh network namespace whose loopback is capped at ``bandwidth``."""
    bits = parse_bandwidth(bandwidth)
    with tempfile.TemporaryDirectory(prefix="hps-bench-ns-") as tmp:
        settings_path, out_path = Path(tmp) / "settings.json", Path(tmp) / "records.json"
        settings_path.write_text(json.dumps(dict(settings, bandwidth=bandwidth)))
        setup = " && ".join(" ".join(c) for c in tc_commands(bits))
        inner = f"{setup} && exec {sys.executable} -m horovod_powersgd.bench --_child {settings_path} {out_path}"  # noqa: E501
        proc = subprocess.run(["unshare", "-n", "sh", "-c", inner], check=False)
        if proc.returncode != 0 or not out_path.exists():
            raise BandwidthCapError(f"the capped run at {bandwidth} exited {proc.returncode}")
        return [Record(**r) for r in json.loads(out_path.read_text())]


def _child(settings_path: str, out_path: str) -> None:
    settings = json.loads(Path(settings_path).read_text())
    settings["plan"] = [tuple(p) for p in settings["plan"]]
    records = run_suite(settings, settings["bandwidth"])
    Path(out_path).write_text(json.dumps([r.as_dict() for r in records]))


def describe_environment(started: str, load_before, load_after) -> str:
    """One paragraph on where the numbers come from: versions, cores, how busy the machine was."""
    import platform

    import torch

    try:
        import horovod

        hvd_version = horovod.__version__
    except ImportError:
        hvd_version = "not installed"
    return (
        f"Run {started} on {platform.machine()} Linux, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, torch {torch.__version__}, Horovod {hvd_version}. "
        f"1-minute load average {load_before[0]:.1f} before and {load_after[0]:.1f} after the "
        f"run (above {os.cpu_count()} means other work shared the cores)."
    )


def render(records, args, command: str, environment) -> None:
    """Table on stdout, then the --plot and --markdown outputs that were asked for.

    ``environment`` is called only when a report is written (it reads the load).
    """
    print(report.format_table(records))
    if args.plot:
        report.plot(records, args.plot)
    if args.markdown:
        report.write_markdown(
            records,
            args.markdown,
            command=command,
            plot=args.plot,
            environment=environment(),
        )


def _check_paired(plan, paired: bool) -> None:
    """horovod-slowed means something only beside plain Horovod in one paired job."""
    configs = {c for c, _ in plan}
    if targets.SLOWED in configs and not (paired and "horovod" in configs):
        raise ValueError(f"{targets.SLOWED} needs --paired and horovod in --configs")


def _add_paired_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--paired",
        action="store_true",
        help="one job per model and link: every configuration in it, visited in interleaved "
        "blocks, ratios with 95 %% intervals (DDP ones still run as jobs of their own)",
    )
    p.add_argument("--block-steps", type=int, default=3, help="--paired: timed steps per block")
    p.add_argument(
        "--min-rounds",
        type=int,
        default=confidence.MIN_ROUNDS,
        help="--paired: rounds before a stop (fewer than %(default)s give no interval)",
    )
    p.add_argument("--max-rounds", type=int, default=1000, help="--paired: at most")
    p.add_argument(
        "--budget-s",
        type=float,
        default=900,
        help="--paired: seconds of timed rounds per job (after every configuration's warm-up) "
        "before it stops, if no earlier every interval its targets need is within +-1 %%",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.01,
        help="--paired: stop when every needed interval is within +- this fraction",
    )
    p.add_argument(
        "--slowdown",
        type=float,
        default=0.05,
        help="--paired: horovod-slowed sleeps this fraction of its own step",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m horovod_powersgd.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = argparse.ArgumentDefaultsHelpFormatter
    p.formatter_class = type("F", (argparse.RawDescriptionHelpFormatter, d), {})
    p.add_argument("-np", type=int, default=2, help="worker processes per configuration")
    p.add_argument("--models", default="resnet18", help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma list, NAME:R for one rank")
    p.add_argument("--ranks", default="1,2,4", help="PowerSGD ranks of the `powersgd` config")
    p.add_argument(
        "--compare-rank", type=int, default=2, help="rank of powersgd-fp16 and ddp-powersgd"
    )
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--warmup-steps", type=int, default=5, help="untimed steps (> start-iter)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of every configuration, interleaved (forward, backward, ...); "
        "the statistics pool the steps of all runs",
    )
    p.add_argument(
        "--start-iter",
        type=int,
        default=2,
        help="uncompressed steps first (torch's hook needs >= 2)",
    )
    p.add_argument("--min-compression-rate", type=float, default=2.0)
    _add_paired_arguments(p)
    p.add_argument(
        "--controller",
        choices=("mpi", "gloo"),
        default="mpi",
        help="Horovod launcher: mpirun or horovodrun --gloo",
    )
    p.add_argument(
        "--bandwidth",
        default="unlimited",
        help="comma list of loopback caps (e.g. unlimited,1gbit,200mbit); "
        "each capped one runs in its own network namespace",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch/OpenMP threads per worker (default: cores // np, >= 1)",
    )
    p.add_argument("--cycle-time-ms", type=float, default=None, help="HOROVOD_CYCLE_TIME for all")
    p.add_argument(
        "--fusion-threshold-mb", type=float, default=None, help="HOROVOD_FUSION_THRESHOLD for all"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=1800,
        help="seconds per configuration; --paired: seconds a job may go without a step",
    )
    p.add_argument("--json", type=Path, help="write the records as a JSON list here")
    p.add_argument("--plot", type=Path, help="write a PNG of median step times here")
    p.add_argument("--markdown", type=Path, help="write a report (tables, targets) here")
    p.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        help="run nothing: re-render table, plot and report from --json files (merged)",
    )
    p.add_argument("--command-line", default=None, help=argparse.SUPPRESS)
    p.add_argument("--environment", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args._child:
        _child(*args._child)
        return 0
    try:
        ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
        bandwidths = [format_bandwidth(parse_bandwidth(b)) for b in args.bandwidth.split(",")]
        plan = parse_configs(args.configs, ranks, args.compare_rank)
        models = [m.strip() for m in args.models.split(",") if m.strip()]
        for m in models:
            if m not in MODELS:
                raise ValueError(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
        if args.warmup_steps <= args.start_iter:
            raise ValueError("--warmup-steps must exceed --start-iter so timed steps compress")
        if args.steps < 1 or args.np < 1 or args.repeat < 1 or args.block_steps < 1:
            raise ValueError("--steps, --repeat, --block-steps and -np must be >= 1")
        _check_paired(plan, args.paired)
        if any(b != "unlimited" for b in bandwidths):
            check_namespace_support()
    except (ValueError, BandwidthCapError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    settings = {
        "np": args.np,
        "models": models,
        "plan": plan,
        "batch_size": args.batch_size,
        "warmup_steps": args.warmup_steps,
        "steps": args.steps,
        "repeat": args.repeat,
        "start_iter": args.start_iter,
        "min_compression_rate": args.min_compression_rate,
        "controller": args.controller,
        "threads": args.threads or max(1, (os.cpu_count() or 1) // args.np),
        "cycle_time_ms": args.cycle_time_ms,
        "fusion_threshold_mb": args.fusion_threshold_mb,
        "timeout_s": args.timeout,
        "paired": args.paired,
        "block_steps": args.block_steps,
        "min_rounds": args.min_rounds,
        "max_rounds": args.max_rounds,
        "budget_s": args.budget_s,
        "tolerance": args.tolerance,
        "slowdown": args.slowdown,
    }
    if args.from_json:
        records = [Record(**r) for path in args.from_json for r in json.loads(path.read_text())]
        command = args.command_line or "(re-rendered from saved records)"
        render(records, args, command, lambda: args.environment or "")
        return 0
    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    records: list[Record] = []
    for bw in bandwidths:
        try:
            records += run_suite(settings, bw) if bw == "unlimited" else run_capped(settings, bw)
        except BandwidthCapError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    shown = list(argv) if argv is not None else sys.argv[1:]
    command = args.command_line or " ".join(["python -m horovod_powersgd.bench", *shown])
    if args.json:
        args.json.write_text(json.dumps([r.as_dict() for r in records], indent=1) + "\n")
    render(
        records,
        args,
        command,
        lambda: describe_environment(started, load_before, os.getloadavg()),
    )
    expected = len(plan) * len(models) * len(bandwidths)
    return 0 if len(records) == expected else 1


if __name__ == "__main__":
    sys.exit(main())
