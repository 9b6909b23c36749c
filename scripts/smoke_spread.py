"""Spread over seeds of the Fashion-MNIST smoke test's test loss (issue 22).

Runs the training loop of
`tests/parallel/test_optimizer.py::test_rank2_converges_like_plain_horovod_on_fashion_mnist`
for plain Horovod and PowerSGD rank 2 with both schedules, once per seed (the
seed sets data order, initialisation and PowerSGD seed), and prints one JSON
line per seed on rank 0. The test's bounds come from these lines
(docs/results/rounds.md).

    mpirun -np 2 --mca mpi_yield_when_idle 1 python scripts/smoke_spread.py --seeds 12
"""

import argparse
import json
import os
import sys

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from fashion_mnist import read_idx

import horovod_powersgd as hps

FASHION = "/usr/share/datasets/fashion-mnist"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=12, help="seeds 0..N-1 (default 12)")
    parser.add_argument("--steps", type=int, default=200, help="steps per run (default 200)")
    parser.add_argument("--lr", type=float, default=0.02, help="SGD learning rate (default 0.02)")
    args = parser.parse_args()
    hvd.init()  # distributed: one process per worker
    images = read_idx(f"{FASHION}/train-images-idx3-ubyte.gz")[:4096].float().div(255).flatten(1)
    labels = read_idx(f"{FASHION}/train-labels-idx1-ubyte.gz")[:4096].long()
    test_x = read_idx(f"{FASHION}/t10k-images-idx3-ubyte.gz")[:1000].float().div(255).flatten(1)
    test_y = read_idx(f"{FASHION}/t10k-labels-idx1-ubyte.gz")[:1000].long()
    shard = slice(hvd.rank(), None, hvd.size())  # distributed: each rank its own share
    x, y = images[shard], labels[shard]

    def run(seed, rank, rounds=2):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
        sgd = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        if rank:
            opt = hps.DistributedOptimizer(
                sgd, model.named_parameters(), rank=rank, rounds=rounds, seed=seed
            )
        else:
            opt = hvd.DistributedOptimizer(sgd, model.named_parameters())
        g = torch.Generator().manual_seed(1000 * seed + hvd.rank())
        for _ in range(args.steps):
            idx = torch.randint(0, len(x), (32,), generator=g)
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        with torch.no_grad():
            return F.cross_entropy(model(test_x), test_y).item()

    for seed in range(args.seeds):
        row = {"seed": seed, "plain": run(seed, 0), "r2": run(seed, 2, 2), "r1": run(seed, 2, 1)}
        if hvd.rank() == 0:  # distributed: print on rank 0 only
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
