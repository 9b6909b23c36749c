"""Long run: memory stays flat and no NaN/Inf appears over thousands of steps.

Launch (what `make long-run` does):
    mpirun --allow-run-as-root -np 2 .venv/bin/python scripts/convergence/long_run.py --steps 2000

Every rank trains a small CNN with horovod_powersgd at rank 2 (different data
on each rank), samples its peak RSS every --every steps and checks that
parameters, error buffers and Q memory are finite. Rank 0 gathers all ranks'
samples and writes a Markdown report (--out) with the command that made it.
"""

import argparse
import resource
import sys
import time

import horovod.torch as hvd
import psutil
import torch
import torch.nn.functional as F
from torch import nn

import horovod_powersgd as hps


def rss_mb():
    return psutil.Process().memory_info().rss / 2**20


def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="training steps (default 2000)")
    parser.add_argument("--every", type=int, default=100, help="sample interval (default 100)")
    parser.add_argument("--out", default="docs/long_run.md", help="report path (rank 0)")
    args = parser.parse_args()

    hvd.init()  # distributed: one process per worker
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 7 * 7, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
    opt = hps.DistributedOptimizer(opt, named_parameters=model.named_parameters(), rank=2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # distributed: same start
    hvd.broadcast_optimizer_state(opt, root_rank=0)  # distributed: same optimizer state

    g = torch.Generator().manual_seed(hvd.rank())  # distributed: different data per rank
    samples = []
    start = time.time()
    for step in range(1, args.steps + 1):
        x = torch.randn(32, 1, 28, 28, generator=g)
        y = torch.randint(0, 10, (32,), generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if step % args.every == 0 or step == 1:
            state = opt.compressor.state_dict()
            finite = all(torch.isfinite(p).all() for p in model.parameters()) and all(
                torch.isfinite(t).all()
                for kind in ("error_buffers", "q_memory")
                for t in state[kind].values()
            )
            samples.append((step, rss_mb(), peak_rss_mb(), bool(finite), loss.item()))
    elapsed = time.time() - start
    gathered = hvd.allgather_object(samples)  # distributed: every rank's samples to all
    if hvd.rank() != 0:
        return
    lines = [
        "# Long run: memory and finiteness",
        "",
        f"Command: `mpirun --allow-run-as-root -np {hvd.size()} .venv/bin/python "
        f"{' '.join(sys.argv)}`",
        "",
        f"{args.steps} steps of a 0.2M-parameter CNN (28x28 inputs, random data, batch 32 "
        f"per worker), horovod_powersgd rank 2, {hvd.size()} workers, CPU, "
        f"{elapsed:.0f} s. RSS sampled every {args.every} steps on every rank. Labels are "
        "random, so the loss stays near ln 10: this run checks memory and finiteness, "
        "not learning (docs/results/convergence.md covers that).",
        "",
        "| step | "
        + " | ".join(f"rank {r} RSS MB" for r in range(len(gathered)))
        + " | all finite | loss (rank 0) |",
        "|---:|" + "---:|" * len(gathered) + "---|---:|",
    ]
    for i, (step, _, _, _, loss) in enumerate(gathered[0]):
        rss = " | ".join(f"{rank_samples[i][1]:.1f}" for rank_samples in gathered)
        finite = all(rank_samples[i][3] for rank_samples in gathered)
        lines.append(f"| {step} | {rss} | {'yes' if finite else 'NO'} | {loss:.3f} |")
    for r, rank_samples in enumerate(gathered):
        # Baseline after the first interval: allocator caches are warm by then.
        base_step, base, *_ = rank_samples[min(1, len(rank_samples) - 1)]
        last_step, last, peak, *_ = rank_samples[-1]
        lines += [
            "",
            f"Rank {r}: RSS {base:.1f} MB at step {base_step}, {last:.1f} MB at step "
            f"{last_step} ({last - base:+.1f} MB); peak {peak:.1f} MB.",
        ]
    all_finite = all(s[3] for rank_samples in gathered for s in rank_samples)
    lines += ["", f"No NaN/Inf in parameters, error buffers or Q memory: {all_finite}."]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
