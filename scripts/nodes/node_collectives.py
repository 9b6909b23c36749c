"""Time the collectives inside a node, as hierarchical PowerSGD runs them, on every node at once.

Run on a cluster of nodes (scripts/nodes/two_nodes.sh starts one on this machine):

    bash scripts/nodes/two_nodes.sh --rate 100mbit -- env HOROVOD_DYNAMIC_PROCESS_SETS=1 \\
        .venv/bin/python scripts/nodes/node_collectives.py --mb 4,16,64

For each size (MB of float32) the node's all-reduce of it, its reduce-scatter as
L rows (the size in all) and its all-gather of one row a worker (size / L each),
the median of --reps after one untimed; then the intra-node hop a ring of L
workers on it would need (`Hop.fit` of the all-reduces, a ring moving
2(L-1)/L of the bytes a link), to give the scale CLI's `--cluster intra=`.
Rank 0 prints one JSON line (``node_collectives {...}``): every rank's medians
and the fitted hop.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import horovod.torch as hvd
import torch

from horovod_powersgd.collectives import Hop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", default="4,16,64", help="sizes, MB of float32")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    hvd.init(process_sets="dynamic")
    local, nodes = hvd.local_size(), hvd.cross_size()
    ranks = [[r for r in range(hvd.size()) if r // local == c] for c in range(nodes)]
    sets = [hvd.add_process_set(r) for r in ranks]  # by-slot placement: node c, ranks c·L...
    node = sets[hvd.cross_rank()]

    def timed(collective, tensor, name: str, **kwargs) -> float:
        def run():
            collective(tensor, name=name, process_set=node, **kwargs)

        run()
        seconds = []
        for _ in range(args.reps):
            hvd.allreduce(torch.zeros(1), name="sync", process_set=node)
            start = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - start)
        return statistics.median(seconds)

    mine = {}
    for mb in [float(x) for x in args.mb.split(",")]:
        n = int(mb * 250_000) // local * local
        mine[mb] = {
            "allreduce_s": timed(hvd.allreduce, torch.randn(n), f"ar{mb}"),
            "reducescatter_s": timed(
                hvd.reducescatter, torch.randn(local, n // local), f"rs{mb}", op=hvd.Sum
            ),
            "allgather_s": timed(hvd.allgather, torch.randn(1, n // local), f"ag{mb}"),
        }
    every = hvd.allgather_object(mine, name="rows")
    if hvd.rank() == 0:
        per_link = 2 * (local - 1) / local
        samples = [
            (mb * 1e6 * per_link, statistics.median(r[mb]["allreduce_s"] for r in every))
            for mb in mine
        ]
        hop = Hop.fit(samples)
        line = {
            "workers_per_node": local,
            "nodes": nodes,
            "by_rank": every,
            # A ring pays 2(L-1) hops' latency: the fit's intercept is that many.
            "intra_hop": {
                "latency_s": hop.latency_s / (2 * (local - 1)),
                "bytes_per_s": hop.bytes_per_s,
            },
        }
        print("node_collectives", json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
