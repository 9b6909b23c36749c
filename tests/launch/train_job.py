"""A small training job for the launch tests (run by mpirun or horovodrun).

--kill-rank R --kill-step S: rank R kills itself with SIGKILL at step S, as
an out-of-memory killer or a lost node would.
--save PATH / --load PATH: checkpoint with horovod_powersgd.save_checkpoint
after the last step / restore before the first one.
--alone save|load --alone-step S: rank 0 alone calls save_checkpoint (load_checkpoint
of --load) at step S, under `if hvd.rank() == 0:` as Horovod's examples save, while
the other ranks train on.
Rank 0 prints one JSON line at the end with a checksum of the parameters.
"""

import argparse
import json
import os
import signal

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn

import horovod_powersgd as hps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--first-step", type=int, default=0)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--save", default=None)
    parser.add_argument("--load", default=None)
    parser.add_argument("--alone", choices=("save", "load"), default=None)
    parser.add_argument("--alone-step", type=int, default=-1)
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = hps.DistributedOptimizer(opt, named_parameters=model.named_parameters(), rank=2)
    if args.load and not args.alone:
        hps.load_checkpoint(args.load, model, opt)
    for step in range(args.first_step, args.first_step + args.steps):
        if hvd.rank() == args.kill_rank and step == args.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if args.alone and step == args.alone_step and hvd.rank() == 0:
            if args.alone == "save":
                hps.save_checkpoint(args.save, model, opt)
            else:
                hps.load_checkpoint(args.load, model, opt)
        g = torch.Generator().manual_seed(1000 * step + hvd.rank())
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    if args.save:
        hps.save_checkpoint(args.save, model, opt)
    state = opt.compressor.state_dict()
    finite = all(torch.isfinite(t).all() for t in state["error_buffers"].values())
    if hvd.rank() == 0:
        result = {
            "size": hvd.size(),
            "params": [p.detach().flatten().tolist()[:8] for p in model.parameters()],
            "error_norm": float(sum(t.norm() for t in state["error_buffers"].values())),
            "finite": bool(finite),
            "powersgd_step": opt.powersgd_step,
        }
        # One write, newline included: the launcher may put other ranks' output
        # (a warning) between two writes, and so inside the line.
        print(json.dumps(result) + "\n", end="")


if __name__ == "__main__":
    main()
