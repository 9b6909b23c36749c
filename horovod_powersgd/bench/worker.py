"""One benchmark worker: train a model on synthetic data and report timings.

Started by the driver (``python -m horovod_powersgd.bench``), once per process,
under ``mpirun`` / ``horovodrun`` for the Horovod configurations and as plain
processes for ``local`` and the DDP ones. Writes ``<out-dir>/rank<r>.json``
with the seconds of every timed step, the elements and bytes it handed to
collectives per step, and its peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path
from typing import Callable

import torch

from .configs import CONFIGS, DDP_CONFIGS, HOROVOD_CONFIGS
from .models import MODELS

AUTO_WARMUP_STEPS = 40
# The counters differenced over the timed steps; compression_stats() has more
# (the ratio so far; under rank="auto" the plan, a list).
COUNTED = ("elements_uncompressed", "elements_sent", "bytes_sent")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def _setup_horovod(args, model) -> tuple[torch.optim.Optimizer, Callable[[], dict], Callable]:
    import horovod.torch as hvd

    if args.config.startswith("powersgd-hier"):  # its process sets are added after init
        os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
    hvd.init()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if args.config.startswith("powersgd"):
        import horovod_powersgd as hps

        opt = hps.DistributedOptimizer(
            opt,
            named_parameters=model.named_parameters(),
            rank="auto" if args.config.endswith("auto") else args.rank,
            rounds=1 if "1round" in args.config else 2,
            start_iter=args.start_iter,
            min_compression_rate=(
                1e12 if args.config == "powersgd-none" else args.min_compression_rate
            ),
            comm_dtype=torch.float16 if args.config.endswith("fp16") else None,
            # Per-layer statistics are on by default; this config measures their cost.
            layer_stats=args.config != "powersgd-nostats",
            hierarchical={"powersgd-hier": True, "powersgd-hier-auto": "auto"}.get(
                args.config, False
            ),
        )
        if args.config == "powersgd-qbyq":
            from .ablation import use_q_by_q

            use_q_by_q(opt)
        counters = opt.compression_stats
    else:
        compression = (
            hvd.Compression.fp16 if args.config == "horovod-fp16" else hvd.Compression.none
        )
        opt = hvd.DistributedOptimizer(
            opt, named_parameters=model.named_parameters(), compression=compression
        )
        numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        elem_bytes = 2 if args.config == "horovod-fp16" else 4
        counters = _static_counters(numel, numel, numel * elem_bytes)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

    def barrier():
        hvd.allreduce(torch.zeros(1), name="bench.barrier")

    return opt, counters, barrier, hvd.rank()


def _setup_ddp(args, model):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    # powerSGD_hook on Gloo with several buckets can fail with "Received data size
    # doesn't match expected size": the P/Q all-reduces of different buckets are
    # issued from future callbacks, whose order can differ across ranks. One
    # bucket (as one fused round in horovod_powersgd) keeps them in order.
    one_bucket_mb = 4 * sum(p.numel() for p in model.parameters()) / 2**20 + 1
    bucket_cap_mb = one_bucket_mb if args.config == "ddp-powersgd" else None
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if args.config == "ddp-powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        state = powersgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=args.rank,
            start_powerSGD_iter=args.start_iter,
            min_compression_rate=args.min_compression_rate,
            use_error_feedback=True,
            warm_start=True,
            random_seed=0,
        )
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)

        def counters():
            # The hook counts cumulatively from its first compressed step only,
            # so the driver differences these over the timed steps.
            after = state.total_numel_after_compression
            return {
                "elements_uncompressed": state.total_numel_before_compression,
                "elements_sent": after,
                "bytes_sent": 4 * after,
            }

    else:
        counters = _static_counters(numel, numel, 4 * numel)
    return opt, counters, dist.barrier, dist.get_rank(), ddp


def _static_counters(uncompressed: int, sent: int, sent_bytes: int):
    """compression_stats()-like counters for a method that sends the same every step."""
    calls = {"steps": 0}

    def counters():
        return {
            "elements_uncompressed": uncompressed * calls["steps"],
            "elements_sent": sent * calls["steps"],
            "bytes_sent": sent_bytes * calls["steps"],
        }

    counters.step = lambda: calls.__setitem__("steps", calls["steps"] + 1)
    return counters


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", choices=CONFIGS, required=True)
    parser.add_argument("--model", choices=sorted(MODELS), default="resnet18")
    parser.add_argument("--rank", type=int, default=2, help="PowerSGD matrix rank")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--start-iter", type=int, default=2)
    parser.add_argument("--min-compression-rate", type=float, default=2.0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)  # same initial model everywhere
    make_model, make_batch, loss_fn = MODELS[args.model]
    model = make_model()

    if args.config in HOROVOD_CONFIGS:
        opt, counters, barrier, rank = _setup_horovod(args, model)
        net = model
    elif args.config in DDP_CONFIGS:
        opt, counters, barrier, rank, net = _setup_ddp(args, model)
    else:  # local: every process trains alone, sharing only the CPU
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        counters = _static_counters(0, 0, 0)
        barrier = lambda: None  # noqa: E731
        rank = int(os.environ["BENCH_RANK"])
        net = model

    generator = torch.Generator().manual_seed(1000 + rank)
    batch = make_batch(args.batch_size, generator)

    phases = {"forward": [], "backward": [], "step": []}

    def train_step():
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(net, batch)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        phases["forward"].append(t1 - t0)
        phases["backward"].append(t2 - t1)
        phases["step"].append(time.perf_counter() - t2)
        if hasattr(counters, "step"):
            counters.step()

    warmup = args.warmup_steps
    if args.config.endswith("auto"):
        warmup = max(warmup, AUTO_WARMUP_STEPS)
    for _ in range(warmup):
        train_step()
    barrier()
    before = dict(counters())
    step_times = []
    for values in phases.values():
        values.clear()
    for _ in range(args.steps):
        start = time.perf_counter()
        train_step()
        step_times.append(time.perf_counter() - start)
    after = dict(counters())
    sent = {k: (after[k] - before[k]) / args.steps for k in COUNTED}
    report = {
        "rank": rank,
        "step_times_s": step_times,
        "elements_uncompressed_per_step": sent["elements_uncompressed"],
        "elements_per_step": sent["elements_sent"],
        "bytes_per_step": sent["bytes_sent"],
        "peak_rss_mb": _peak_rss_mb(),
        # Where a step's time goes (backward includes communication that overlaps it).
        "phase_median_ms": {k: 1e3 * sorted(v)[len(v) // 2] for k, v in phases.items()},
    }
    if args.config.endswith("auto"):  # what auto chose, and the link it measured
        report["plan"] = [opt.compressor.ranks[b.index] for b in opt.powersgd_state.reducer.buckets]
        link = opt.powersgd_state.tuner.measurements.link
        report["link"] = {"latency_ms": 1e3 * link.latency_s, "mbit_s": 8e-6 * link.bytes_per_s}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    barrier()


if __name__ == "__main__":
    main()
