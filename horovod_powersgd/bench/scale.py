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
stepmodel.py's (the one rank="auto" plans with, flat and hierarchical) on
collectives.py's cluster costs; docs/scale.md gives its equations and
assumptions. `--compute` scales every second of local work (backward,
PowerSGD's work, the rest of the step): 0.1 predicts a device ten times as fast
as the one profiled (docs/scale.md says how to pick it).

A profile carries its layout's version in "format" (`stepmodel.PROFILE_FORMAT`; one
without it, written before the field, reads as format 1; another is refused). A bad
input ends the CLI before any work with one line naming it (exit status 2). So does a
profile whose parts do not add up to its own measured step (`stepmodel.
Measurements.consistency`: a CUDA profile from before rank="auto" timed the device), unless
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
import sys

from .. import planner, stepmodel
from ..collectives import ALGORITHMS, CLUSTER_GRAMMAR, ClusterLink, parse_cluster, parse_rate
from ..stepmodel import (
    PLAIN,
    Measurements,
    compute_under_compression,
    hierarchical_s,
    predict,
    uniform,
)


def _halved(m: Measurements) -> Measurements:
    """The job with plain buckets sent in float16 (Horovod's fp16 compression)."""
    buckets = tuple(dataclasses.replace(b, plain_bytes=b.plain_bytes / 2) for b in m.buckets)
    return dataclasses.replace(m, buckets=buckets)


def predictions(
    m: Measurements, cluster, algorithm: str = "nccl", compressed_compute: float = 1.0
) -> dict[str, float]:
    """Configuration -> predicted seconds of one step of the profiled job on `cluster`.

    `compressed_compute` scales the compute of the configurations that compress
    (`compute_under_compression`); 1: every plan computes as the profiled plain steps.
    """
    on = m.with_link(ClusterLink(cluster, algorithm))
    plain = [PLAIN] * len(m.buckets)
    out = {
        "horovod": predict(on, plain),
        "horovod-fp16": predict(_halved(on), plain),
        "horovod-hierarchical": predict(m.with_link(ClusterLink(cluster, "hierarchical")), plain),
    }
    squeezed = m.scaled(compressed_compute) if compressed_compute != 1.0 else m
    busy = squeezed.with_link(ClusterLink(cluster, algorithm))
    ranks = sorted({r for b in m.buckets for r in b.options})
    for rank in ranks:
        out[f"powersgd-r{rank}"] = predict(busy, uniform(busy, rank))
    if cluster.nodes > 1 and cluster.per_node > 1:
        for rank in ranks:
            out[f"powersgd-hier-r{rank}"] = hierarchical_s(squeezed, cluster, rank)
    if ranks:
        plan = planner.choose(on, ranks)
        out["powersgd-auto"] = predict(busy if any(plan) else on, plan)
    return out


# Configurations within this of the shortest predicted step count as fastest; of those
# the first in the table's order wins (plain Horovod first: the exact average).
TIE = 0.01


def _fastest(seconds: dict[str, float]) -> str:
    shortest = min(seconds.values())
    return next(k for k, s in seconds.items() if s <= shortest * (1 + TIE))


def table(
    m: Measurements, cluster, workers, bandwidths, algorithm="nccl", compressed_compute=1.0
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


def _profile(path: str) -> tuple[Measurements, list[dict]]:
    """The profile at `path` and the trials rank="auto" timed (a ValueError says what is
    wrong: the file, its JSON, or the field `Measurements.from_dict` names)."""
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
        return Measurements.from_dict(data), data.get("trials", [])
    except json.JSONDecodeError as error:
        raise ValueError(f"{path!r} is not JSON: {error}") from None
    except ValueError as error:
        raise ValueError(f"{path!r}: {error}") from None


def _consistent(m: Measurements, path: str, how: str):
    """(the profile to predict from, a note or None): `m` where its parts add up to its
    measured step (`stepmodel.CONSISTENT`); else, by `how`, a ValueError ("refuse"), `m`
    ("accept") or `m.corrected()` ("correct"), each of the last two with a note."""
    low, high = stepmodel.CONSISTENT
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
