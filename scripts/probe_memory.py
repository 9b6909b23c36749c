"""Peak RSS added by rank="auto"'s probe steps (6-7), one process, 64 MB of gradients.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/probe_memory.py

docs/auto.md quotes its result (the probes' cost in memory).
"""

import resource

import horovod.torch as hvd
import torch
from torch import nn

import horovod_powersgd as hps
from horovod_powersgd import tuner

hvd.init()
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(16)])
grad_mb = sum(p.numel() for p in model.parameters()) * 4 / 2**20
opt = hps.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.01),
    named_parameters=model.named_parameters(),
    rank="auto",
    auto_link="50mbit",
    layer_stats=False,
)


def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


for step in range(tuner.MEASURE_STEPS):
    if step == min(tuner.PROBE):
        before = peak()
    x = torch.randn(32, 1024)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
print(
    f"gradients {grad_mb:.0f} MB; peak RSS before probes {before:.0f} MB, after {peak():.0f} MB: "
    f"probes added {peak() - before:.0f} MB = {(peak() - before) / grad_mb:.2f}x the gradients"
)
