"""One rank steps once more than the others, then every rank exits (tests/launch/test_faults.py).

Each rank prints one line: "rank R done" when its steps all ended, or "rank R raised
NAME after S s: MESSAGE" when one raised (the extra step, whose partner has exited).
A run still there after 45 s dumps every thread's stack (faulthandler) and exits 1.

    mpirun -np 2 python tests/launch/uneven_exit_job.py --extra-rank 1 --small-buckets
    horovodrun -np 2 -H localhost:2 --gloo python tests/launch/uneven_exit_job.py --rounds 1
"""

import argparse
import faulthandler
import os
import sys
import time

import horovod.torch as hvd
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "parallel"))
from helpers import batch, make_model

import horovod_powersgd as hps
from horovod_powersgd import reducer


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=("powersgd", "horovod"), default="powersgd")
    parser.add_argument("--rounds", type=int, default=2, help="PowerSGD rounds (2)")
    parser.add_argument("--steps", type=int, default=3, help="steps of every rank (3)")
    parser.add_argument("--extra-rank", type=int, default=0, help="the rank that steps once more")
    parser.add_argument("--small-buckets", action="store_true", help="a bucket per layer")
    args = parser.parse_args()
    faulthandler.dump_traceback_later(45, exit=True)
    if args.small_buckets:
        reducer.BUCKET_BYTES = 2048
    hvd.init()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if args.optimizer == "powersgd":
        opt = hps.DistributedOptimizer(
            opt, named_parameters=model.named_parameters(), rank=2, rounds=args.rounds
        )
    else:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    steps = args.steps + (1 if hvd.rank() == args.extra_rank else 0)
    start = time.monotonic()
    try:
        for step in range(steps):
            x, y = batch(step)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        print(f"rank {hvd.rank()} done", flush=True)
    except Exception as e:
        print(
            f"rank {hvd.rank()} raised {type(e).__name__} after {time.monotonic() - start:.1f} s: "
            f"{str(e)[:80]}",
            flush=True,
        )


if __name__ == "__main__":
    main()
