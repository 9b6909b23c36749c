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

A profile carries its layout's version in "format" (`planner.PROFILE_FORMAT`; one
without it, written before the field, reads as format 1; another is refused). A bad
input ends the CLI before any work with one line naming it (exit status 2). So does a
profile whose parts do not add up to its own measured step (`planner.Measurements.
consistency`: a CUDA profile from before rank="auto" timed the device), unless
`--inconsistent correct` (its rest of the step set to fit) or `accept` (as it is).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import re
import statistics
import sys

from .. import planner, shares
from ..collectives import (
    ALGORITHMS,
    CLUSTER_GRAMMAR,
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


def hierarchical(m: planner.Measurements, cluster) -> list[planner.Measurements]:
    """The profiled job as hierarchical PowerSGD on `cluster`: one `Measurements` per local
    rank, each that worker's step (docs/scale.md; the step is the slowest's).

    Every bucket of a compressed step takes the library's four stages: the node's
    collectives (hierarchy.py's packs, `shares.scatters`: a reduce-scatter of L
    rows of the longest share and an all-gather of them, or the bucket all-reduced
    whole twice) on the intra-node hop, before the bucket's local work and after
    its rounds, on the worker's one queue of collectives; between them the share's
    P, Q and uncompressed tensors cross the N nodes, the L shares at once on the
    node's NICs. Local rank j's share is `shares.owners`' split of the profile's
    tensors; its local work is the bucket's measured work times its share of the
    compressed elements. A profile without tensor sizes (written before they
    were recorded) is split evenly: the work / L, the bytes as L equal shares.
    """
    per_node = cluster.per_node
    ranks = sorted({r for b in m.buckets for r in b.options})
    if not all(b.tensors for b in m.buckets):
        return [_even_shares(m, cluster, ranks)]
    split = shares.owners([[t.numel for t in b.tensors] for b in m.buckets], per_node)
    stages = [_node_stages(b.tensors, owner, cluster) for b, owner in zip(m.buckets, split)]
    out = []
    for j in range(per_node):
        buckets = []
        for b, owner, (before, after) in zip(m.buckets, split, stages):
            mine = [t for t, k in zip(b.tensors, owner) if k == j]
            options = {}
            for r in ranks:
                compressed = sum(t.numel for t in b.tensors if r in t.factors)
                part = (
                    sum(t.numel for t in mine if r in t.factors) / compressed if compressed else 0
                )
                o = b.options.get(r, planner.Option(0.0, 0.0, 0.0))
                first, second = planner.message_bytes(mine, r, m.rounds)
                options[r] = planner.Option(
                    o.compress_s * part, o.work_s * part, first, second, before, after
                )
            buckets.append(dataclasses.replace(b, options=options))
        out.append(dataclasses.replace(m, buckets=tuple(buckets), link=ShareLink(cluster, False)))
    return out


def _node_stages(tensors, owner, cluster) -> tuple[float, float]:
    """Seconds of a bucket's node collectives before its local work, and after its rounds."""
    per_node, intra = cluster.per_node, cluster.intra
    packs = {}
    for t, j in zip(tensors, owner):
        sizes, owners = packs.setdefault(t.element_bytes, ([], []))
        sizes.append(t.numel)
        owners.append(j)
    if shares.scatters(list(packs.values()), per_node):
        rows = sum(
            size * per_node * max(1, *shares.rows(n, o, per_node)) for size, (n, o) in packs.items()
        )
        return (
            collective_s("reduce_scatter", rows, per_node, intra),
            collective_s("all_gather", rows, per_node, intra),
        )
    whole = collective_s("ring", sum(t.numel * t.element_bytes for t in tensors), per_node, intra)
    return whole, whole


def _even_shares(m: planner.Measurements, cluster, ranks) -> planner.Measurements:
    """A profile without tensor sizes: every bucket split into L equal shares."""
    per_node = cluster.per_node

    def stage(kind: str, nbytes: float) -> float:
        return collective_s(kind, nbytes, per_node, cluster.intra)

    buckets = []
    for b in m.buckets:
        before, after = stage("reduce_scatter", b.plain_bytes), stage("all_gather", b.plain_bytes)
        options = {}
        for r in ranks:
            o = b.options.get(r, planner.Option(0.0, 0.0, b.plain_bytes))
            options[r] = dataclasses.replace(
                o,
                compress_s=o.compress_s / per_node,
                work_s=o.work_s / per_node,
                before_s=before,
                after_s=after,
            )
        buckets.append(dataclasses.replace(b, options=options))
    return dataclasses.replace(m, buckets=tuple(buckets), link=ShareLink(cluster))


def hierarchical_s(m: planner.Measurements, cluster, rank: int) -> float:
    """Predicted seconds of a hierarchical PowerSGD step at `rank`: the slowest share's."""
    return max(planner.predict(s, planner.uniform(s, rank)) for s in hierarchical(m, cluster))


def compute_under_compression(m: planner.Measurements, trials: list[dict]) -> float | None:
    """The factor on the profile's compute that puts the model's step of each fully
    compressed plan rank="auto" timed in the profiled job at what it measured (the
    median over those plans; None: none timed). About 1 with a device per worker;
    above 1 where workers share cores and compute at once only when the link is not
    the wait (docs/scale.md: 3 workers on 2 cores, x1.7).

    A plan counts where every bucket that can be compressed is: its messages are small
    beside its compute, so the factor is the compute's. They are charged at the
    profile's fitted bandwidth without its fitted latency, the least reliable part of
    a fit to a few bucket sizes (0.37 s an all-reduce on the two-node LSTM's profile,
    which would put 5 s of latency in a step of 6).

    Example:
        >>> o = planner.Option(compress_s=0.0, work_s=0.0, round1_bytes=1e3)
        >>> b = planner.Bucket(ready_s=0.5, plain_bytes=1e8, options={2: o})
        >>> m = planner.Measurements((b,), 0.5, 2.0, planner.Link(0.0, 1e9), rest_s=0.5)
        >>> round(compute_under_compression(m, [{"plan": [2], "step_s": 1.5}]), 3)
        1.5
    """
    bytes_only = m.with_link(planner.Link(0.0, m.link.bytes_per_s))

    def step(factor: float, plan) -> float:
        return planner.predict(bytes_only.scaled(factor), plan)

    factors = []
    for trial in trials:
        plan, measured = trial["plan"], trial["step_s"]
        if not any(plan) or any(r == planner.PLAIN and b.options for r, b in zip(plan, m.buckets)):
            continue  # a plain bucket's all-reduce: the link's time, not the compute's
        low, high = 0.05, 20.0
        if not step(low, plan) <= measured <= step(high, plan):
            continue
        for _ in range(60):
            mid = (low * high) ** 0.5
            low, high = (mid, high) if step(mid, plan) < measured else (low, mid)
        factors.append((low * high) ** 0.5)
    return statistics.median(factors) if factors else None


def predictions(
    m: planner.Measurements, cluster, algorithm: str = "nccl", compressed_compute: float = 1.0
) -> dict[str, float]:
    """Configuration -> predicted seconds of one step of the profiled job on `cluster`.

    `compressed_compute` scales the compute of the configurations that compress
    (`compute_under_compression`); 1: every plan computes as the profiled plain steps.
    """
    on = m.with_link(ClusterLink(cluster, algorithm))
    plain = [planner.PLAIN] * len(m.buckets)
    out = {
        "horovod": planner.predict(on, plain),
        "horovod-fp16": planner.predict(_halved(on), plain),
        "horovod-hierarchical": planner.predict(
            m.with_link(ClusterLink(cluster, "hierarchical")), plain
        ),
    }
    squeezed = m.scaled(compressed_compute) if compressed_compute != 1.0 else m
    busy = squeezed.with_link(ClusterLink(cluster, algorithm))
    ranks = sorted({r for b in m.buckets for r in b.options})
    for rank in ranks:
        out[f"powersgd-r{rank}"] = planner.predict(busy, planner.uniform(busy, rank))
    if cluster.nodes > 1 and cluster.per_node > 1:
        for rank in ranks:
            out[f"powersgd-hier-r{rank}"] = hierarchical_s(squeezed, cluster, rank)
    if ranks:
        plan = planner.choose(on, ranks)
        out["powersgd-auto"] = planner.predict(busy if any(plan) else on, plan)
    return out


# Configurations within this of the shortest predicted step count as fastest; of those
# the first in the table's order wins (plain Horovod first: the exact average).
TIE = 0.01


def _fastest(seconds: dict[str, float]) -> str:
    shortest = min(seconds.values())
    return next(k for k, s in seconds.items() if s <= shortest * (1 + TIE))


def table(
    m: planner.Measurements, cluster, workers, bandwidths, algorithm="nccl", compressed_compute=1.0
) -> list[dict]:
    """One row per (workers, inter-node bandwidth): predicted ms and speedups."""
    rows = []
    for count in workers:
        sized = cluster.with_workers(count)
        for bandwidth in bandwidths:
            on = sized.with_inter(parse_rate(bandwidth))
            seconds = predictions(m, on, algorithm, compressed_compute)
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


def _argument(read):
    """`read` as an argparse type: the message of its ValueError is the error line."""

    def parse(text: str):
        try:
            return read(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse


def _each(read):
    """Comma-separated values, each through `read` (an error names the list too)."""

    def parse(text: str) -> list:
        try:
            return [read(part.strip()) for part in text.split(",")]
        except ValueError as error:
            raise ValueError(f"{error} (in {text!r})" if "," in text else str(error)) from None

    return parse


def _count(text: str) -> int:
    if not re.fullmatch(r"[0-9]+", text) or int(text) < 1:
        raise ValueError(f"expected worker counts >= 1 like '2,8,64', got {text!r}")
    return int(text)


def _checked(parse):
    """The text itself, once `parse` takes it (the work parses it again)."""

    def check(text: str) -> str:
        parse(text)
        return text

    return check


def _factor(text: str, expected: str = "a factor > 0 like 0.1") -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise ValueError(f"expected {expected}, got {text!r}")
    return value


def _compressed(text: str) -> float | str:
    return text if text == "trials" else _factor(text, 'a factor > 0 like 1.4, or "trials"')


def _output(path: str) -> str:
    """A file written after the work: refused before it where it cannot be written."""
    folder = os.path.dirname(path) or "."
    if os.path.isdir(path):
        raise ValueError(f"{path!r} is a folder, not a file")
    if not os.path.isdir(folder):
        raise ValueError(f"no folder {folder!r} to write {path!r} in")
    if not os.access(path if os.path.exists(path) else folder, os.W_OK):
        raise ValueError(f"{path!r} cannot be written (permissions)")
    return path


def _profile(path: str) -> tuple[planner.Measurements, list[dict]]:
    """The profile at `path` and the trials rank="auto" timed (a ValueError says what is
    wrong: the file, its JSON, or the field `planner.Measurements.from_dict` names)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as error:
        raise ValueError(f"cannot read {path!r}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path!r} is not JSON text") from None
    if not text.strip():
        raise ValueError(f"{path!r} is empty")
    try:
        data = json.loads(text)
        return planner.Measurements.from_dict(data), data.get("trials", [])
    except json.JSONDecodeError as error:
        raise ValueError(f"{path!r} is not JSON: {error}") from None
    except ValueError as error:
        raise ValueError(f"{path!r}: {error}") from None


def _consistent(m: planner.Measurements, path: str, how: str):
    """(the profile to predict from, a note or None): `m` where its parts add up to its
    measured step (`planner.CONSISTENT`); else, by `how`, a ValueError ("refuse"), `m`
    ("accept") or `m.corrected()` ("correct"), each of the last two with a note."""
    low, high = planner.CONSISTENT
    ratio = m.consistency()
    if low <= ratio <= high:
        return m, None
    link = "none: one worker" if m.workers == 1 else "its fitted link"
    found = (
        f"the model's plain step on the link it was measured on ({link}) is "
        f"{1e3 * ratio * m.step_s:.1f} ms, its measured step {1e3 * m.step_s:.1f} ms "
        f"({ratio:.2f}x; a profile is read within {low:g}-{high:g}x)"
    )
    again = (
        'take it again with this version (on CUDA, rank="auto" now times the device with '
        "CUDA events)"
    )
    if how == "refuse":
        raise ValueError(
            f"{path!r}: its parts do not add up to its step: {found}; {again}, or pass "
            "--inconsistent correct (its rest of the step set to fit) or accept (as it is)"
        )
    if how == "accept":
        return m, f"Note: {path} taken as it is, though {found}."
    fixed = m.corrected()
    if not low <= fixed.consistency() <= high:
        raise ValueError(
            f"{path!r}: its parts do not add up to its step: {found}, and no rest of the "
            f"step corrects it (the model's window on that link alone is longer); {again}, or pass "
            "--inconsistent accept"
        )
    return fixed, (
        f"Note: {path} corrected: rest_s {1e3 * m.rest_s:.1f} ms -> {1e3 * fixed.rest_s:.1f} "
        f"ms, so that its plain step on the link it was measured on is its measured step, "
        f"{1e3 * m.step_s:.1f} ms (it was {1e3 * ratio * m.step_s:.1f} ms)."
    )


def _parser() -> argparse.ArgumentParser:
    """The CLI's arguments; each type refuses a bad value with one line naming it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", required=True, help="a HOROVOD_POWERSGD_PROFILE file")
    parser.add_argument(
        "--cluster",
        required=True,
        type=_argument(_checked(parse_cluster)),
        help=f'nodes of the cluster: "{CLUSTER_GRAMMAR}"',
    )
    parser.add_argument(
        "--workers",
        type=_argument(_each(_count)),
        default="2,4,8,16,32,64,128,256,512,1024",
        help="worker counts: at most L, or whole nodes of L (default: %(default)s)",
    )
    parser.add_argument(
        "--bandwidths",
        type=_argument(_each(_checked(parse_rate))),
        default="1gbit,10gbit,25gbit,100gbit",
        help="inter-node rates, each per NIC (default: %(default)s)",
    )
    parser.add_argument(
        "--compute", type=_argument(_factor), default=1.0, help="time scale of local work (> 0)"
    )
    parser.add_argument(
        "--compressed-compute",
        type=_argument(_compressed),
        default="1",
        help="time scale of compressing configurations' compute on top of --compute: a "
        'factor, or "trials": from the compressed steps the profiled job timed (workers '
        "sharing cores; docs/scale.md)",
    )
    parser.add_argument(
        "--inconsistent",
        choices=("refuse", "correct", "accept"),
        default="refuse",
        help="a profile whose parts do not add up to its measured step: refuse it, correct "
        "its rest of the step to fit, or accept it as it is (default: %(default)s)",
    )
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="nccl")
    parser.add_argument("--json", type=_argument(_output), help="write the rows here")
    parser.add_argument(
        "--plot", type=_argument(_output), help="write a PNG of the speedups here (matplotlib)"
    )
    return parser


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    # What the arguments' types cannot check alone, checked before the work too: a bad
    # input ends with parser.error's one line (exit status 2), never half-way through.
    try:
        measured, trials = _profile(args.profile)
        measured, note = _consistent(measured, args.profile, args.inconsistent)
    except ValueError as error:
        parser.error(f"argument --profile: {error}")
    squeeze = args.compressed_compute
    if squeeze == "trials":
        squeeze = compute_under_compression(measured, trials)
        if squeeze is None:
            parser.error(
                f"argument --compressed-compute: {args.profile!r} has no compressed step "
                'timed by rank="auto" (no "trials"): give a factor'
            )
    cluster = parse_cluster(args.cluster)
    for count in args.workers:
        try:
            cluster.with_workers(count)
        except ValueError as error:
            per_node = cluster.per_node
            parser.error(
                f"argument --workers: {error} (--cluster's L): give {per_node} or fewer, "
                f"or a multiple of {per_node}"
            )
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("argument --plot: needs matplotlib (pip install matplotlib)")
    profile = measured.scaled(args.compute)
    rows = table(profile, cluster, args.workers, args.bandwidths, args.algorithm, squeeze)
    if note:
        print(note)
    print(
        f"Profile {args.profile} (rounds={profile.rounds}, {len(profile.buckets)} buckets, "
        f"compute x{args.compute:g}"
        + (f", compressing x{squeeze:.3g}" if squeeze != 1.0 else "")
        + f"); cluster {args.cluster}; all-reduce {args.algorithm}. "
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
