"""The runs that calibrate PowerSGD's early warning (horovod_powersgd/monitor.py).

Trains the Fashion-MNIST example's CNN as scripts/error_growth.py does (first
20k training images, batch 64 per worker, SGD momentum 0.9, weight decay 5e-4)
and prints on rank 0, at every check of the statistics (every 10 steps), the
whole model's error and gradient norms (moving averages, mean of the ranks),
then when the ErrorGrowthWarning fired and when the loss became non-finite.

    # diverges (docs/results/rounds.md): the warning must come first
    mpirun -np 2 python scripts/warning_calibration.py --rounds 1 --lr 0.1 --start-iter 100
    # the examples' settings: no warning
    mpirun -np 2 python scripts/warning_calibration.py --rounds 2 --lr 0.02 --start-iter 0
"""

import argparse
import math
import os
import sys
import warnings

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import horovod_powersgd as hps

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from fashion_mnist import DEFAULT_DATA_DIR, Net, load_split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, choices=(1, 2), default=1)
    parser.add_argument("--rank", type=int, default=2, help="PowerSGD rank")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--start-iter", type=int, default=100, help="plain steps first")
    parser.add_argument("--seed", type=int, default=42, help="model and data order")
    args = parser.parse_args()

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    images, labels = load_split(DEFAULT_DATA_DIR, "train", 20000).tensors
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    opt = hps.DistributedOptimizer(
        opt,
        named_parameters=model.named_parameters(),
        rank=args.rank,
        rounds=args.rounds,
        start_iter=args.start_iter,
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    generator = torch.Generator().manual_seed(hvd.rank() + 100 * args.seed)
    warned = None
    for step in range(1, args.steps + 1):
        idx = torch.randint(0, len(images), (64,), generator=generator)
        opt.zero_grad()
        loss = F.cross_entropy(model(images[idx]), labels[idx])
        loss.backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        if any(issubclass(w.category, hps.ErrorGrowthWarning) for w in caught):
            warned = warned or step
            report(f"ErrorGrowthWarning at step {step}: {caught[0].message}")
        stats = opt.compression_stats(per_layer=True)
        if stats["checked_step"] == step:
            report(
                f"step {step:4d}  loss {loss.item():9.4f}  error norm {stats['error_norm']:9.3f}  "
                f"gradient norm {stats['gradient_norm']:9.3f}"
            )
        if not math.isfinite(loss.item()):
            report(f"non-finite loss at step {step}; warned at step {warned}")
            return
    report(f"finite to step {args.steps}; warned at step {warned}")


def report(line: str) -> None:
    if hvd.rank() == 0:
        print(line, flush=True)


if __name__ == "__main__":
    main()
