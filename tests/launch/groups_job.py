"""Two trainings in one MPI job, for the launch tests (run by mpirun -np 4).

mpi4py splits COMM_WORLD into two halves and each starts Horovod on its own
(`hvd.init(comm=half)`), then trains with PowerSGD for --steps steps.
--process-sets: one Horovod world instead, each half a process set made from its
communicator (`hvd.init(comm=COMM_WORLD, process_sets=[hvd.ProcessSet(half)])`).
--raise-rank R --raise-step S: world rank R raises a RuntimeError at step S, as a
bug or a bad input in one member of an ensemble would.
Every rank writes OUTCOMES/rank<world rank>.json when it ends: the steps it finished,
or its error. A file, not a line on stdout: once the first process exits non-zero,
mpirun ends the others and may drop what they printed last.
"""

import argparse
import json
import os
import time

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

import horovod_powersgd as hps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("outcomes", help="folder for one JSON file per rank")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--raise-rank", type=int, default=-1)
    parser.add_argument("--raise-step", type=int, default=-1)
    parser.add_argument("--process-sets", action="store_true")
    args = parser.parse_args()

    world = MPI.COMM_WORLD
    member = world.rank * 2 // world.size
    half = world.Split(color=member, key=world.rank)
    process_set = hvd.global_process_set
    if args.process_sets:
        process_set = hvd.ProcessSet(half)
        hvd.init(comm=world, process_sets=[process_set])
    else:
        hvd.init(comm=half)
    outcome = {"world_rank": world.rank, "member": member}
    try:
        torch.manual_seed(member)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        opt = hps.DistributedOptimizer(
            opt, named_parameters=model.named_parameters(), rank=2, process_set=process_set
        )
        world.Barrier()  # both groups start their steps together (imports take a while here)
        for step in range(args.steps):
            if world.rank == args.raise_rank and step == args.raise_step:
                raise RuntimeError(f"injected failure on world rank {world.rank} at step {step}")
            g = torch.Generator().manual_seed(1000 * step + half.rank)
            x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        outcome["finished_steps"] = args.steps
    except Exception as e:
        outcome["error"] = f"{type(e).__name__}: {e}"
        raise  # the traceback, and a non-zero exit
    finally:
        outcome["time"] = time.time()
        with open(os.path.join(args.outcomes, f"rank{world.rank}.json"), "w") as f:
            json.dump(outcome, f)


if __name__ == "__main__":
    main()
