"""A/B of how a rank waits for PowerSGD's all-reduces, on the Fashion-MNIST example's CNN.

Three variants take turns in one job (rounds alternate their order): plain
``hvd.DistributedOptimizer``, PowerSGD rank 2 with our poll-and-sleep wait, and
PowerSGD rank 2 waiting with ``hvd.synchronize`` (Horovod's spin). Synthetic
batches; prints rank 0's median step time of each variant in ms.

    mpirun -np 2 --mca mpi_yield_when_idle 1 python scripts/perf_wait.py --rounds 4
    horovodrun -np 2 -H localhost:2 python scripts/perf_wait.py --rounds 4 --steps 50
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import horovod_powersgd as hps
from horovod_powersgd import comm as hps_comm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from fashion_mnist import Net  # the example's model

WAITS = {"poll": hps_comm.wait, "spin": hvd.synchronize}


def run(variant: str, steps: int, batch) -> list[float]:
    torch.manual_seed(0)
    model = Net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if variant == "plain":
        opt = hvd.DistributedOptimizer(sgd, model.named_parameters())
    else:
        hps_comm.Comm.wait = staticmethod(WAITS[variant])  # the waits of every step
        opt = hps.DistributedOptimizer(sgd, model.named_parameters(), rank=2)
    times = []
    for i in range(steps + 5):  # 5 untimed: Horovod's first negotiations, warm-up steps
        start = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(batch[0]), batch[1]).backward()
        opt.step()
        if i >= 5:
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60, help="timed steps per variant and round")
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(hvd.rank())
    batch = (
        torch.randn(args.batch_size, 1, 28, 28, generator=g),
        torch.randint(0, 10, (args.batch_size,), generator=g),
    )
    results: dict[str, list[float]] = {"plain": [], "poll": [], "spin": []}
    for r in range(args.rounds):
        order = list(results) if r % 2 == 0 else list(reversed(results))
        for variant in order:
            results[variant] += run(variant, args.steps, batch)
    if hvd.rank() == 0:
        medians = {k: round(1e3 * statistics.median(v), 1) for k, v in results.items()}
        print(f"median step ms: {medians}")


if __name__ == "__main__":
    main()
