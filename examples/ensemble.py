"""An ensemble trained inside one MPI program: one Horovod + PowerSGD training per communicator.

An MPI program that owns ``MPI.COMM_WORLD`` (a simulation, a sweep driver) splits it
with mpi4py and starts Horovod on its part with ``hvd.init(comm=part)``. Each member of
the ensemble is then a Horovod world of its own: its own ``hvd.rank()`` and
``hvd.size()``, collectives, PowerSGD state and checkpoint, trained side by side with
the others. At the end the members' first ranks average their predicted probabilities
over ``MPI.COMM_WORLD``: the ensemble's test accuracy beside each member's.

Launch (from the repository root), with mpirun:

    # 2 members x 2 workers, Fashion-MNIST, PowerSGD rank 2
    mpirun -np 4 python examples/ensemble.py --members 2
    # 3 members x 2 workers; a checkpoint per member and epoch, resumed when rerun
    mpirun -np 6 python examples/ensemble.py --members 3 --checkpoint-dir ckpt

MPI only: under ``horovodrun --gloo`` every process is an MPI program of its own and
Horovod ignores ``comm=``, so the script stops with an error (docs/mpi4py.md).
The data are Debian's ``dataset-fashion-mnist`` files, as for fashion_mnist.py.
"""

from __future__ import annotations

import argparse
import os
import sys

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common
from fashion_mnist import CLASSES, DEFAULT_DATA_DIR, load_split

import horovod_powersgd as hps


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="An ensemble of Fashion-MNIST MLPs, one Horovod + PowerSGD training each",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--members", type=int, default=2, help="trainings; divides the ranks")
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="folder with the IDX files")
    parser.add_argument("--epochs", type=int, default=2, help="epochs per member")
    parser.add_argument("--batch-size", type=int, default=64, help="batch size per worker")
    parser.add_argument("--lr", type=float, default=0.02, help="learning rate per worker")
    parser.add_argument("--seed", type=int, default=42, help="member m uses seed + m")
    parser.add_argument("--powersgd-rank", type=int, default=2, help="0: plain Horovod")
    parser.add_argument("--train-subset", type=int, default=0, help="first N images (0: all)")
    parser.add_argument("--eval-subset", type=int, default=0, help="first N test images (0: all)")
    parser.add_argument("--checkpoint-dir", default="", help="member<m>.pt per member; resumed")
    return parser


def member_of(world, members: int) -> int:
    """Contiguous blocks of ranks: member m holds world ranks [m*k, (m+1)*k)."""
    if members < 1 or world.Get_size() % members:
        raise SystemExit(f"--members {members} must divide the {world.Get_size()} MPI processes")
    return world.Get_rank() * members // world.Get_size()


def main(argv=None) -> dict:
    """Train this rank's member, then score the ensemble; returns this rank's record.

    The record: member, seed, workers, first_epoch (after a resume, the one after the
    checkpoint's), ratio (PowerSGD), the trained model and, on each member's first
    rank, test_accuracy and ensemble_accuracy.
    """
    args = build_parser().parse_args(argv)
    world = MPI.COMM_WORLD
    member = member_of(world, args.members)
    comm = world.Split(color=member, key=world.Get_rank())  # MPI: this member's processes
    hvd.init(comm=comm)  # Horovod: one Horovod world per member
    if hvd.size() != comm.Get_size():
        raise SystemExit(
            f"Horovod runs {hvd.size()} processes, the member's communicator has "
            f"{comm.Get_size()}: Horovod ignored comm= (Gloo has no MPI communicators; "
            "launch with mpirun) or was initialised before"
        )
    seed = args.seed + member  # members differ by their seed alone
    torch.manual_seed(seed)

    train_set = load_split(args.data_dir, "train", args.train_subset)
    test_set = load_split(args.data_dir, "t10k", args.eval_subset)
    # Horovod: each worker of the member trains on its own shard.
    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(), seed=seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    model = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 256), nn.ReLU(), nn.Linear(256, CLASSES))
    # Horovod: scale the learning rate by the member's number of workers.
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    if args.powersgd_rank:
        # Horovod + PowerSGD: compressed all-reduce among the member's workers.
        optimizer = hps.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(), rank=args.powersgd_rank
        )
    else:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    # Horovod: start the member's workers from its rank 0's weights and optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    path = os.path.join(args.checkpoint_dir, f"member{member}.pt") if args.checkpoint_dir else ""
    first_epoch = 1
    if path and os.path.exists(path):
        # PowerSGD: every worker of the member resumes its own state (error buffers too).
        first_epoch = hps.load_checkpoint(path, model, optimizer)["epoch"] + 1

    for epoch in range(first_epoch, args.epochs + 1):
        sampler.set_epoch(epoch)  # Horovod: a new shuffle per epoch, same on the member's ranks
        model.train()
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        if path:
            os.makedirs(args.checkpoint_dir, exist_ok=True)
            hps.save_checkpoint(path, model, optimizer, epoch=epoch)  # every worker of the member

    record = {"member": member, "seed": seed, "workers": hvd.size(), "first_epoch": first_epoch}
    record["model"] = model
    if args.powersgd_rank:
        record["ratio"] = optimizer.compression_stats()["ratio"]
    # MPI: the members' first ranks, the only ones that score (their workers are identical).
    leaders = world.Split(color=0 if hvd.rank() == 0 else MPI.UNDEFINED, key=world.Get_rank())
    if leaders != MPI.COMM_NULL:
        model.eval()
        with torch.no_grad():
            x, y = test_set.tensors
            probabilities = F.softmax(model(x), dim=1)
        record["test_accuracy"] = (probabilities.argmax(1) == y).float().mean().item()
        # MPI: the ensemble's prediction is the mean of the members' probabilities.
        leaders.Allreduce(MPI.IN_PLACE, probabilities, op=MPI.SUM)
        record["ensemble_accuracy"] = (probabilities.argmax(1) == y).float().mean().item()
        accuracies = leaders.gather(record["test_accuracy"], root=0)
        if leaders.Get_rank() == 0:
            members = ", ".join(f"{a:.4f}" for a in accuracies)
            common.write_line(
                f"Final: {args.members} members x {hvd.size()} workers; test accuracy of each "
                f"member {members}; of the ensemble {record['ensemble_accuracy']:.4f}"
            )
        leaders.Free()
    return record


if __name__ == "__main__":
    main()
