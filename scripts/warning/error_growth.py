"""Watch PowerSGD's error buffers while training: why rounds=1 can diverge.

Trains the Fashion-MNIST example's CNN on the first 20k training images and
prints every 10 steps, on rank 0: the loss, the norm of this rank's raw
gradient, of the aggregated gradient the optimizer applies, and of the error
buffers. A healthy run keeps the aggregate near the raw gradient and the
error bounded; a diverging one releases a growing error in ever larger updates.

    mpirun -np 2 --mca mpi_yield_when_idle 1 python scripts/warning/error_growth.py --rounds 1
    mpirun -np 2 --mca mpi_yield_when_idle 1 python scripts/warning/error_growth.py --rounds 2

`--error-decay` and `--error-bound` are experiments on rounds=1, not library
features: they shrink this rank's error buffer after every compression (by a
factor, or to at most that multiple of the gradient's norm).
"""

import argparse
import math
import os
import sys

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import horovod_powersgd as hps
from horovod_powersgd.compressor import PowerSGDCompressor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from fashion_mnist import DEFAULT_DATA_DIR, Net, load_split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, choices=(1, 2), default=1)
    parser.add_argument("--rank", type=int, default=2, help="PowerSGD rank")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--start-iter", type=int, default=100, help="plain steps first")
    parser.add_argument("--error-decay", type=float, default=1.0, help="experiment, see above")
    parser.add_argument("--error-bound", type=float, default=0.0, help="experiment, see above")
    args = parser.parse_args()
    if args.rounds == 2 and (args.error_decay != 1.0 or args.error_bound):
        parser.error("--error-decay/--error-bound act on rounds=1's error buffers only")

    hvd.init()
    torch.set_num_threads(1)
    if args.error_decay != 1.0 or args.error_bound:
        shrink_error_after_compress(args.error_decay, args.error_bound)
    torch.manual_seed(42)
    images, labels = load_split(DEFAULT_DATA_DIR, "train", 20000).tensors
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=5e-4)
    opt = hps.DistributedOptimizer(
        opt,
        named_parameters=model.named_parameters(),
        rank=args.rank,
        rounds=args.rounds,
        start_iter=args.start_iter,
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    generator = torch.Generator().manual_seed(hvd.rank())
    for step in range(args.steps):
        idx = torch.randint(0, len(images), (64,), generator=generator)
        opt.zero_grad()
        loss = F.cross_entropy(model(images[idx]), labels[idx])
        loss.backward()
        raw = norm(p.grad for p in model.parameters())
        opt.synchronize()
        applied = norm(p.grad for p in model.parameters())
        with opt.skip_synchronize():
            opt.step()
        error = norm(opt.compressor.state_dict()["error_buffers"].values())
        finite = math.isfinite(loss.item())
        if hvd.rank() == 0 and (step % 10 == 0 or not finite):
            print(
                f"step {step:4d}  loss {loss.item():8.4f}  raw {raw:9.3f}  "
                f"applied {applied:9.3f}  error {error:9.3f}",
                flush=True,
            )
        if not finite:
            break


def norm(tensors) -> float:
    return math.sqrt(sum(float(t.norm()) ** 2 for t in tensors))


def shrink_error_after_compress(decay: float, bound: float) -> None:
    compress = PowerSGDCompressor.compress

    def shrinking(self, name, grad):
        compress(self, name, grad)
        group, i = self._where[name]
        error = group.matrices[i]  # rounds=1 keeps the new error here already
        error.mul_(decay)
        if bound and grad is not None:
            limit = bound * float(grad.norm())
            size = float(error.norm())
            if size > limit:
                error.mul_(limit / size)

    PowerSGDCompressor.compress = shrinking


if __name__ == "__main__":
    main()
