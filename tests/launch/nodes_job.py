"""A small PowerSGD training on a cluster of nodes (scripts/nodes/two_nodes.sh runs it).

Every rank prints one JSON line: where it ran (host, local and cross rank and
size), the time of a 4 MB all-reduce over all ranks (the node link), the bytes
this rank sent and a digest of its parameters after training.
"""

import hashlib
import json
import socket
import time

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn

import horovod_powersgd as hps


def main():
    hvd.init()
    hvd.allreduce(torch.zeros(1), name="warm")
    start = time.perf_counter()
    hvd.allreduce(torch.zeros(2**20), name="link")
    link_s = time.perf_counter() - start
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10))  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = hps.DistributedOptimizer(opt, named_parameters=model.named_parameters(), rank=2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(10):
        g = torch.Generator().manual_seed(1000 * step + hvd.rank())
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    row = {
        "rank": hvd.rank(), "host": socket.gethostname(), "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(),
        "cross_size": hvd.cross_size(), "link_s": link_s, "params": digest.hexdigest(),
        "ratio": opt.compression_stats()["ratio"],
    }  # fmt: skip
    print("nodes_job " + json.dumps(row) + "\n", end="")  # one write: lines stay whole


if __name__ == "__main__":
    main()
