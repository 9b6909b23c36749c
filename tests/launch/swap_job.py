"""A user's script that puts the library in Horovod's place with a wrapper function, then
resumes the Horovod way: rank 0 alone loads the optimizer's state, then
`hvd.broadcast_optimizer_state` (whose initialising step, on the ranks with no state,
must be the wrapped optimizer's plain step: no collective).

    mpirun -np 2 python tests/launch/swap_job.py
"""

import io

import horovod.torch as hvd
import torch
from torch import nn

import horovod_powersgd as hps  # its optimizer module is not imported yet: after the swap


def wrapped(*args, **kwargs):  # the user's own wrapper, put in Horovod's place
    return hps.DistributedOptimizer(*args, rank=4, **kwargs)


hvd.DistributedOptimizer = wrapped


def build(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())


def train(model, opt, steps, first):
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(100 * step + hvd.rank())
        opt.zero_grad()
        model(torch.randn(16, 32, generator=g)).pow(2).mean().backward()
        opt.step()


def main():
    hvd.init()
    model, opt = build(0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    train(model, opt, 3, first=0)
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, saved)

    resumed, resumed_opt = build(1)
    print(f"rank {hvd.rank()}: optimizer module {type(resumed_opt).__module__}", flush=True)
    if hvd.rank() == 0:
        saved.seek(0)
        state = torch.load(saved, weights_only=True)
        resumed.load_state_dict(state["model"])
        resumed_opt.load_state_dict(state["optimizer"])
    hvd.broadcast_parameters(resumed.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(resumed_opt, root_rank=0)
    train(resumed, resumed_opt, 3, first=3)
    flat = torch.cat([p.detach().reshape(-1) for p in resumed.parameters()])
    gathered = hvd.allgather(flat.reshape(1, -1), name="swap.params")
    assert all(torch.equal(row, gathered[0]) for row in gathered), "ranks differ"
    print(f"rank {hvd.rank()}: resumed in step", flush=True)


if __name__ == "__main__":
    main()
