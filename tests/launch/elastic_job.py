"""Elastic training job for tests/launch/test_elastic.py (run by horovodrun).

Trains a small model with horovod_powersgd under hvd.elastic.run. Rank 0
rewrites the host-discovery file at given steps, so the set of workers changes
during the run. Every rank appends one JSON line per step to --record-file.
"""

import argparse
import json
import os
import time

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn

import horovod_powersgd as hps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--hosts-file", required=True)
    parser.add_argument("--record-file", required=True)
    # "STEP:HOSTS" pairs: at STEP rank 0 writes HOSTS into the discovery file
    parser.add_argument("--changes", nargs="*", default=[])
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step")
    parser.add_argument("--rank", default="2", help='PowerSGD rank, or "auto"')
    args = parser.parse_args()
    rank = args.rank if args.rank == "auto" else int(args.rank)
    changes = {int(s): h for s, h in (c.split(":", 1) for c in args.changes)}

    hvd.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = hps.DistributedOptimizer(opt, named_parameters=model.named_parameters(), rank=rank)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)

    @hvd.elastic.run
    def train(state):
        while state.step < args.steps:
            g = torch.Generator().manual_seed(1000 * state.step + hvd.rank())
            x = torch.randn(16, 32, generator=g)
            y = torch.randint(0, 10, (16,), generator=g)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            state_of = opt.compressor.state_dict()
            finite = all(
                torch.isfinite(t).all()
                for kind in ("error_buffers", "q_memory")
                for t in state_of[kind].values()
            )
            checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
            q_sum = float(sum(t.double().sum() for t in state_of["q_memory"].values()))
            with open(args.record_file, "a") as f:
                f.write(
                    json.dumps(
                        {
                            "pid": os.getpid(),
                            "rank": hvd.rank(),
                            "size": hvd.size(),
                            "step": state.step,
                            "powersgd_step": opt.powersgd_step,
                            # the world size the error buffers belong to
                            "residual_world": opt._agreement.world_size,
                            "loss": loss.item(),
                            "finite": bool(finite),
                            "params": checksum,
                            "q_memory": q_sum,
                            "plan": [
                                opt.compressor.ranks[b.index]
                                for b in opt.powersgd_state.reducer.buckets
                            ],
                            "plans_taken": getattr(opt.powersgd_state.tuner, "changes", 0),
                        }
                    )
                    + "\n"
                )
            if hvd.rank() == 0 and state.step in changes:
                with open(args.hosts_file, "w") as f:
                    f.write(changes[state.step].replace(",", "\n") + "\n")
            time.sleep(args.step_seconds)
            state.step += 1
            state.commit()

    train(state)


if __name__ == "__main__":
    main()
