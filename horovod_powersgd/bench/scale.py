"""Predicted step times on clusters this machine is not: from a profile of your own job.

    # 1. A profile: a short rank="auto" job of your model (auto's measuring steps),
    #    with the first rank writing what auto measured:
    HOROVOD_POWERSGD_PROFILE=profile.json horovodrun -np 2 python train.py ...
    # 2. Predictions for a cluster: nodes of 8 workers, NVLink-like inside a node,
    #    Ethernet between, 2 to 1,024 workers, four inter-node bandwidths:
    python -m horovod_powersgd.bench.scale --profile profile.json \
        --cluster "1x8,intra=100GB/2us,inter=25gbit/20us" \
        --workers 2,8,64,1024 --bandwidths 1gbit,10gbit,25gbit,100gbit --compute 0.1

For each worker count and inter-node bandwidth it prints the predicted step
time of plain Horovod (fp32, fp16, hierarchical), PowerSGD at each rank the
profile measured (the profile's schedule), hierarchical PowerSGD at those
ranks (clusters of several nodes of several workers) and rank="auto"'s plan, and the
speedup of each over plain Horovod; "*" marks the fastest (the first in
the table within 1 % of the shortest). The step model is
planner.py's (the one rank="auto" plans with) on collectives.py's cluster
costs; docs/scale.md gives its equations and assumptions. `--compute` scales
every second of local work (backward, PowerSGD's work, the rest of the step):
0.1 predicts a device ten times as fast as the one profiled (docs/scale.md says
how to pick it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from .. import planner
from ..collectives import (
    ALGORITHMS,
    ClusterLink,
    ShareLink,
    collective_s,
    parse_cluster,
    parse_rate,
)


def _halved(m: planner.Measurements) -> planner.Measurements:
    """The job with plain buckets sent in float16 (Horovod's fp16 compression)."""
    buckets = tuple(dataclasses.replace(b, plain_bytes=b.plain_bytes / 2) for b in m.buckets)
    return dataclasses.replace(m, buckets=buckets)


def hierarchical(m: planner.Measurements, cluster) -> planner.Measurements:
    """The profiled job as hierarchical PowerSGD on `cluster` (docs/hierarchical.md).

    Each bucket's local work is split over the node's L workers (measured: 0.51-0.56
    of flat's per worker at L = 2); it starts once the node's reduce-scatter of the
    bucket is back (the intra-node hop, before the bucket can leave); P, Q and the
    uncompressed tensors cross as L shares (`ShareLink`); the all-gather of the last
    bucket ends the step (earlier ones overlap the later buckets on the other link).
    """
    per_node = cluster.per_node

    def inside(nbytes: float) -> float:
        return collective_s("reduce_scatter", nbytes, per_node, cluster.intra)

    buckets = tuple(
        dataclasses.replace(
            b,
            options={
                r: dataclasses.replace(
                    o,
                    compress_s=inside(b.plain_bytes) + o.compress_s / per_node,
                    work_s=o.work_s / per_node,
                )
                for r, o in b.options.items()
            },
        )
        for b in m.buckets
    )
    last = inside(m.buckets[-1].plain_bytes) if m.buckets else 0.0
    return dataclasses.replace(m, buckets=buckets, link=ShareLink(cluster), rest_s=m.rest_s + last)


def predictions(m: planner.Measurements, cluster, algorithm: str = "nccl") -> dict[str, float]:
    """Configuration -> predicted seconds of one step of the profiled job on `cluster`."""
    on = m.with_link(ClusterLink(cluster, algorithm))
    plain = [planner.PLAIN] * len(m.buckets)
    out = {
        "horovod": planner.predict(on, plain),
        "horovod-fp16": planner.predict(_halved(on), plain),
        "horovod-hierarchical": planner.predict(
            m.with_link(ClusterLink(cluster, "hierarchical")), plain
        ),
    }
    ranks = sorted({r for b in m.buckets for r in b.options})
    for rank in ranks:
        out[f"powersgd-r{rank}"] = planner.predict(on, planner.uniform(on, rank))
    if cluster.nodes > 1 and cluster.per_node > 1:
        shared = hierarchical(m, cluster)
        for rank in ranks:
            out[f"powersgd-hier-r{rank}"] = planner.predict(shared, planner.uniform(shared, rank))
    if ranks:
        out["powersgd-auto"] = planner.predict(on, planner.choose(on, ranks))
    return out


# Configurations within this of the shortest predicted step count as fastest; of those
# the first in the table's order wins (plain Horovod first: the exact average).
TIE = 0.01


def _fastest(seconds: dict[str, float]) -> str:
    shortest = min(seconds.values())
    return next(k for k, s in seconds.items() if s <= shortest * (1 + TIE))


def table(m: planner.Measurements, cluster, workers, bandwidths, algorithm="nccl") -> list[dict]:
    """One row per (workers, inter-node bandwidth): predicted ms and speedups."""
    rows = []
    for count in workers:
        sized = cluster.with_workers(count)
        for bandwidth in bandwidths:
            seconds = predictions(m, sized.with_inter(parse_rate(bandwidth)), algorithm)
            plain = seconds["horovod"]
            rows.append(
                {
                    "workers": count,
                    "nodes": sized.nodes,
                    "bandwidth": bandwidth,
                    "step_ms": {k: 1e3 * s for k, s in seconds.items()},
                    "speedup": {k: plain / s for k, s in seconds.items()},
                    "fastest": _fastest(seconds),
                }
            )
    return rows


def markdown(rows: list[dict]) -> str:
    # Every row's configurations, in first-seen order: one node's rows have no
    # hierarchical columns, several nodes' do.
    configs = list(dict.fromkeys(c for row in rows for c in row["step_ms"]))
    lines = [
        "| workers | nodes | inter-node | " + " | ".join(configs) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in configs) + " |",
    ]
    for row in rows:
        cells = [
            f"{row['step_ms'][c]:.1f} ms ({row['speedup'][c]:.2f}x)"
            + ("*" if c == row["fastest"] else "")
            if c in row["step_ms"]
            else "-"
            for c in configs
        ]
        lines.append(
            f"| {row['workers']} | {row['nodes']} | {row['bandwidth']} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    """The best fixed-rank PowerSGD's speedup over plain Horovod, by workers, per bandwidth.

    (rank="auto" is left out: where PowerSGD does not pay it sends plain, at 1.0.)
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for bandwidth in dict.fromkeys(r["bandwidth"] for r in rows):
        mine = [r for r in rows if r["bandwidth"] == bandwidth]
        best = [
            max((v for k, v in r["speedup"].items() if k.startswith("powersgd-r")), default=1.0)
            for r in mine
        ]
        ax.plot([r["workers"] for r in mine], best, marker="o", label=f"inter-node {bandwidth}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("workers")
    ax.set_ylabel("best fixed-rank PowerSGD: speedup over Horovod")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", required=True, help="a HOROVOD_POWERSGD_PROFILE file")
    parser.add_argument(
        "--cluster",
        required=True,
        help='nodes of the cluster: "NxL,intra=RATE/LATENCY,inter=RATE/LATENCY[,nics=K]"',
    )
    parser.add_argument("--workers", default="2,4,8,16,32,64,128,256,512,1024")
    parser.add_argument("--bandwidths", default="1gbit,10gbit,25gbit,100gbit")
    parser.add_argument("--compute", type=float, default=1.0, help="time scale of local work")
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="nccl")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--plot", help="write a PNG of the speedups here")
    args = parser.parse_args(argv)
    with open(args.profile) as f:
        profile = planner.Measurements.from_dict(json.load(f)).scaled(args.compute)
    cluster = parse_cluster(args.cluster)
    workers = [int(w) for w in args.workers.split(",")]
    rows = table(profile, cluster, workers, args.bandwidths.split(","), args.algorithm)
    print(
        f"Profile {args.profile} (rounds={profile.rounds}, {len(profile.buckets)} buckets, "
        f"compute x{args.compute:g}); cluster {args.cluster}; all-reduce {args.algorithm}. "
        "Predicted step, speedup over plain Horovod; * fastest."
    )
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
