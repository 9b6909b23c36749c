"""Shared by the parallel tests: a small model, per-rank data, a training loop, checks."""

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn

import horovod_powersgd as hps

# Where the model and the data live: the CPU, or CUDA under `pytest --device cuda`
# (conftest.py), as the GPU kit runs the user contract there (scripts/gpu/gpu_check.py).
DEVICE = torch.device("cpu")


def make_model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 10)
    ).to(DEVICE, dtype)


def batch(step, rank=None, size=16, dtype=torch.float32):
    """Different data on every rank and step, reproducible."""
    g = torch.Generator().manual_seed(1000 * step + (hvd.rank() if rank is None else rank))
    x = torch.randn(size, 32, generator=g, dtype=dtype)
    y = torch.randint(0, 10, (size,), generator=g)
    return x.to(DEVICE), y.to(DEVICE)


def train(model, opt, steps, first_step=0, dtype=torch.float32):
    for step in range(first_step, first_step + steps):
        x, y = batch(step, dtype=dtype)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def assert_same_on_every_rank(tensor, name):
    gathered = hvd.allgather(tensor.detach().reshape(1, -1).float(), name=f"same.{name}")
    for r in range(1, hvd.size()):
        assert torch.equal(gathered[r], gathered[0]), f"{name} differs between rank 0 and {r}"


def powersgd(model, **kwargs):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return hps.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **kwargs)


def local_gradients(model, loss):
    """This rank's own gradients of `loss`, computed without touching `p.grad`.

    The optimizer's hooks fire as `p.grad` accumulates and all-reduce the
    uncompressed gradients in place, in the background, as Horovod does: a copy
    of `p.grad` taken between backward and synchronize() may already hold part
    of the average. `torch.autograd.grad` accumulates nothing, so no hook fires.
    """
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    grads = torch.autograd.grad(loss, params, retain_graph=True)
    return dict(zip(names, grads))
