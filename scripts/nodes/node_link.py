"""What each configuration sends over the node link, and each worker's compression work.

Run on a cluster of nodes (scripts/nodes/two_nodes.sh starts one on this machine):

    bash scripts/nodes/two_nodes.sh --rate 100mbit -- .venv/bin/python scripts/nodes/node_link.py \\
        --model resnet18 --configs horovod,powersgd:2,powersgd:4,powersgd-hier:2,powersgd-hier:4

For each configuration, after --warmup steps: the bytes the nodes' network
interfaces sent during --steps steps (eth0's tx_bytes, read by local rank 0 of
every node, summed: everything that crossed the link, headers included), the
bytes the library says it sent over it, and each worker's CPU seconds inside
the PowerSGD compressor (thread time of its calls: the local work). Rank 0
prints one JSON line per configuration (``node_link {...}``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import torch

from horovod_powersgd.bench.models import MODELS

# Every public call of the compressor's step (none calls another): the flat reducer's
# compress_bucket, project_all and decompress_all too (until 2026-12-06 they were left
# out, so its figures from when the reducer took them up were too low).
COMPRESSOR_CALLS = ("begin_step", "compress", "compress_bucket", "send_buffers", "project",
                    "project_all", "update_error", "decompress", "decompress_all")  # fmt: skip


def tx_bytes() -> int:
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
        return int(f.read())


def timed(compressor, spent: list[float]) -> None:
    """Add the thread time of every compressor call to spent[0]."""
    for name in COMPRESSOR_CALLS:
        method = getattr(compressor, name)

        @functools.wraps(method)
        def wrapper(*a, _method=method, **kw):
            start = time.thread_time()
            try:
                return _method(*a, **kw)
            finally:
                spent[0] += time.thread_time() - start

        setattr(compressor, name, wrapper)


def idle(hvd, seconds: float, label: str) -> dict:
    """Bytes the link carries per second while every rank sleeps: Horovod's background
    coordination (each process set's, every cycle), with the process sets that exist now."""
    hvd.allreduce(torch.zeros(1), name=f"{label}.before")
    before = tx_bytes() if hvd.local_rank() == 0 else 0
    time.sleep(seconds)
    link = (tx_bytes() - before) if hvd.local_rank() == 0 else 0
    rows = hvd.allgather_object(link, name=f"{label}.rows")
    return {"config": label, "idle_s": seconds, "link_bytes_per_s": sum(rows) / seconds}


def measure(hvd, args, config: str, rank: int | None) -> dict:
    import horovod_powersgd as hps

    make_model, make_batch, loss_fn = MODELS[args.model]
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    spent = [0.0]
    if config == "horovod":
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    else:
        opt = hps.DistributedOptimizer(
            opt, named_parameters=model.named_parameters(),
            rank="auto" if config.endswith("-auto") else rank,
            rounds=1 if config.startswith("powersgd-1round") else 2,
            hierarchical=config == "powersgd-hier", start_iter=args.start_iter,
        )  # fmt: skip
        timed(opt.compressor, spent)
    batch = make_batch(args.batch_size, torch.Generator().manual_seed(1000 + hvd.rank()))

    def step():
        opt.zero_grad()
        loss_fn(model, batch).backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    hvd.allreduce(torch.zeros(1), name=f"{config}{rank}.before")
    spent[0] = 0.0
    before = tx_bytes() if hvd.local_rank() == 0 else 0
    sent_before = opt.compression_stats()["bytes_sent"] if config != "horovod" else 0
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    seconds = time.perf_counter() - start
    hvd.allreduce(torch.zeros(1), name=f"{config}{rank}.after")
    link = (tx_bytes() - before) if hvd.local_rank() == 0 else 0
    said = (opt.compression_stats()["bytes_sent"] - sent_before) if config != "horovod" else 0
    rows = hvd.allgather_object([link, said, spent[0], seconds], name=f"{config}{rank}.rows")
    if config == "horovod" and args.horovod_hierarchical:
        config = "horovod-hierarchical"
    return {
        "model": args.model, "config": config, "rank": rank, "steps": args.steps,
        "link_bytes_per_step": sum(r[0] for r in rows) / args.steps,
        "library_bytes_per_step": sum(r[1] for r in rows) / args.steps,
        "compression_ms_per_step": [1000 * r[2] / args.steps for r in rows],
        "step_s": max(r[3] for r in rows) / args.steps,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", choices=sorted(MODELS), default="resnet18")
    p.add_argument(
        "--configs",
        default="horovod,powersgd:2,powersgd-hier:2",
        help="horovod, powersgd:R, powersgd-1round:R (rounds=1), powersgd-hier:R, "
        "powersgd-auto, powersgd-1round-auto, idle:SECONDS",
    )
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument(
        "--start-iter",
        type=int,
        default=0,
        help="plain steps first (powersgd-auto measures the last 8 of them)",
    )
    p.add_argument(
        "--horovod-hierarchical",
        action="store_true",
        help="HOROVOD_HIERARCHICAL_ALLREDUCE=1 (Horovod's own, for every config)",
    )
    p.add_argument(
        "--cycle-time-ms",
        type=float,
        default=None,
        help="HOROVOD_CYCLE_TIME: how often Horovod's thread coordinates",
    )
    p.add_argument(
        "--profile",
        default=None,
        help="HOROVOD_POWERSGD_PROFILE: powersgd-auto writes its measurements here "
        "(bench.scale's profile; --warmup 12 lets it measure, or past --start-iter)",
    )
    args = p.parse_args()
    os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
    if args.profile:
        os.environ["HOROVOD_POWERSGD_PROFILE"] = args.profile
    if args.cycle_time_ms is not None:
        os.environ["HOROVOD_CYCLE_TIME"] = str(args.cycle_time_ms)
    if args.horovod_hierarchical:
        os.environ["HOROVOD_HIERARCHICAL_ALLREDUCE"] = "1"
    import horovod.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    for item in args.configs.split(","):
        config, _, rank = item.partition(":")
        if config == "idle":  # idle:N, N seconds
            sets = len(hvd.mpi_ops._basics._get_process_set_ids_and_ranks())
            row = idle(hvd, float(rank or 3), f"idle, {sets} process sets")
        else:
            row = measure(hvd, args, config, int(rank) if rank else None)
        if hvd.rank() == 0:
            print("node_link " + json.dumps(row) + "\n", end="", flush=True)


if __name__ == "__main__":
    main()
