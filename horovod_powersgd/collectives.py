"""What one collective costs on a cluster: the alpha-beta model, in one table.

Pure (no Horovod, no tensors). A hop moves n bytes in `latency_s + n / bytes_per_s`.
A collective over W workers takes a number of sequential steps, each paying a
hop's latency, and puts a share of its n bytes on every link:

    | collective                | latency steps   | bytes on each link |
    | ring all-reduce           | 2(W-1)          | 2(W-1)/W · n       |
    | tree all-reduce           | 2·ceil(log2 W)  | 2 · n              |
    | ring reduce-scatter       | W-1             | (W-1)/W · n        |
    | ring all-gather           | W-1             | (W-1)/W · n        |

(the tree row is a reduce up and a broadcast down a binary tree, pipelined, as
NCCL's double binary tree: latency grows with log2 W, but each byte crosses a
link twice.) On a cluster of N nodes of L workers, with an intra-node hop and an
inter-node hop (per NIC, `nics` NICs a node):

* flat all-reduce (NCCL's choice, "nccl"): the faster of ring and tree, as
  NCCL's tuner picks one by size and scale from its own table (the model does
  not know NCCL's table, only the two costs); across nodes every step waits for
  the slower, inter-node hop, whose bandwidth the node's NICs add up (one ring
  per NIC, as NCCL's channels do);
* hierarchical all-reduce (Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE): reduce-
  scatter inside each node, an all-reduce of each 1/L shard across the N nodes
  (the L shards share the node's NICs), all-gather inside the node.

* hierarchical PowerSGD (hierarchy.py): P and Q of each 1/L share are
  all-reduced by one worker per node across the N nodes, the node's L shares at
  once, sharing its NICs (`ShareLink`); the node's reduce-scatter before and
  all-gather after ride the intra-node hop (stepmodel.hierarchical adds them).

`ClusterLink` gives the step model (stepmodel.py) the cost of one all-reduce on a
cluster in the same form as a `Hop` measured on this machine, so one step
model serves the running job and the scale CLI (bench/scale.py).
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

# kind -> (latency steps, bytes on each link per byte) for W >= 2 workers.
TABLE = {
    "ring": (lambda w: 2 * (w - 1), lambda w: 2 * (w - 1) / w),
    "tree": (lambda w: 2 * math.ceil(math.log2(w)), lambda w: 2.0),
    "reduce_scatter": (lambda w: w - 1, lambda w: (w - 1) / w),
    "all_gather": (lambda w: w - 1, lambda w: (w - 1) / w),
}
ALGORITHMS = ("ring", "tree", "nccl", "hierarchical")
# A timed all-reduce of at most this many bytes gives `Hop.fit` the latency (its bytes
# take 0.5 ms at 1 Gbit/s): rank="auto" times a few of 4 bytes (tuner._time_link).
SMALL_BYTES = 64 * 1024


@dataclass(frozen=True)
class Hop:
    """One link: `latency_s` per message, `bytes_per_s` of bandwidth. Between two workers
    of a cluster, or a job's whole all-reduce as rank="auto" measures it (`fit`): an
    all-reduce of `n` bytes then takes `seconds(n)`."""

    latency_s: float
    bytes_per_s: float

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s

    @staticmethod
    def fit(samples: Sequence[tuple[float, float]]) -> Hop:
        """The hop of timed all-reduces, (bytes, seconds) each: the bandwidth by least
        squares (over those above SMALL_BYTES where they have two sizes or more); the
        latency what the smallest took, less its bytes' time, where they are at most
        SMALL_BYTES (the median of that size's), else the least-squares intercept; >= 0.

        Not the intercept always: an all-reduce of megabytes timed alone pays start-up
        costs that a small message does not, nor one of a step's back-to-back transfers
        (a TCP link's slow start after idle: the LSTM's buckets on two nodes at 100 Mbit/s
        fitted 0.35 s, where a message of bytes takes milliseconds; docs/auto.md), and the
        step model charges the latency to every P and Q, which are small.

        Example:
            >>> hop = Hop.fit([(1e3, 0.01001), (1e6, 0.02), (4e6, 0.05)])
            >>> round(hop.latency_s, 3), round(hop.bytes_per_s / 1e6)
            (0.01, 100)
            >>> hop = Hop.fit([(4, 0.002), (4, 0.003), (4, 0.0025), (7e6, 1.0), (75e6, 7.8)])
            >>> round(hop.latency_s, 4), round(hop.bytes_per_s / 1e6, 1)  # not 0.3 s
            (0.0025, 10.0)
        """
        if not samples:
            raise ValueError("no timed all-reduce to fit the link to")
        xs, ys = [float(b) for b, _ in samples], [float(s) for _, s in samples]
        bulk = [(x, y) for x, y in zip(xs, ys) if x > SMALL_BYTES]
        if len({x for x, _ in bulk}) < 2:
            bulk = list(zip(xs, ys))
        mean_x, mean_y = (sum(v) / len(bulk) for v in zip(*bulk))
        spread = sum((x - mean_x) ** 2 for x, _ in bulk)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in bulk) / spread if spread else 0
        if slope <= 0:  # all of one size, or no cost per byte: all of it is latency
            return Hop(latency_s=max(sum(ys) / len(ys), 0.0), bytes_per_s=math.inf)
        latency = mean_y - slope * mean_x
        smallest = min(xs)
        if smallest <= SMALL_BYTES:
            latency = statistics.median(y - slope * x for x, y in zip(xs, ys) if x == smallest)
        return Hop(latency_s=max(latency, 0.0), bytes_per_s=1.0 / slope)

    def scaled(self, bandwidth: float) -> Hop:
        """The same hop with `bandwidth` times the bytes per second."""
        return Hop(self.latency_s, self.bytes_per_s * bandwidth)


def collective_s(kind: str, nbytes: float, workers: int, hop: Hop) -> float:
    """Seconds of one collective of `kind` (TABLE) over `workers` on links like `hop`.

    Example:
        >>> hop = Hop(latency_s=1e-5, bytes_per_s=1e9)
        >>> round(collective_s("ring", 1e6, 4, hop) * 1e6)  # 6 steps, 1.5 MB a link
        1560
        >>> round(collective_s("tree", 1e6, 4, hop) * 1e6)  # 4 steps, 2 MB a link
        2040
    """
    if workers <= 1:
        return 0.0
    steps, share = TABLE[kind]
    return steps(workers) * hop.latency_s + share(workers) * nbytes / hop.bytes_per_s


def per_link(allreduce: Hop, workers: int) -> Hop:
    """The link between two of `workers` under a ring all-reduce that takes
    `allreduce.seconds(n)` for n bytes (`collective_s`'s ring, inverted): how rank="auto"
    turns an all-reduce it timed into the hop of a cluster's model.

    Example:
        >>> hop = Hop(latency_s=1e-5, bytes_per_s=1e9)
        >>> timed = Hop(6e-5, 1e9 / 1.5)  # a ring of 4: 6 steps, 1.5 x the bytes a link
        >>> round(collective_s("ring", 1e6, 4, hop), 9) == round(timed.seconds(1e6), 9)
        True
        >>> back = per_link(timed, 4)
        >>> round(back.latency_s * 1e6), round(back.bytes_per_s / 1e9, 3)
        (10, 1.0)
    """
    if workers <= 1:
        return allreduce
    steps, share = TABLE["ring"]
    return Hop(allreduce.latency_s / steps(workers), allreduce.bytes_per_s * share(workers))


@dataclass(frozen=True)
class Cluster:
    """N `nodes` of L workers (`per_node`), linked by `intra` inside a node and `inter` between."""

    nodes: int
    per_node: int
    intra: Hop
    inter: Hop
    nics: int = 1

    def __post_init__(self):
        if self.nodes < 1 or self.per_node < 1 or self.nics < 1:
            raise ValueError(f"a cluster needs nodes, per_node and nics >= 1: {self}")

    @property
    def workers(self) -> int:
        return self.nodes * self.per_node

    def with_inter(self, bytes_per_s: float) -> Cluster:
        return Cluster(
            self.nodes, self.per_node, self.intra, Hop(self.inter.latency_s, bytes_per_s), self.nics
        )

    def with_workers(self, workers: int) -> Cluster:
        """The same nodes' kind, `workers` in all (whole nodes; fewer than one node: one)."""
        if workers <= self.per_node:
            return Cluster(1, workers, self.intra, self.inter, self.nics)
        if workers % self.per_node:
            raise ValueError(f"{workers} workers are not whole nodes of {self.per_node}")
        return Cluster(workers // self.per_node, self.per_node, self.intra, self.inter, self.nics)


def allreduce_s(nbytes: float, cluster: Cluster, algorithm: str = "nccl") -> float:
    """Seconds of one all-reduce of `nbytes` on `cluster` (module docstring).

    Example:
        >>> fast, slow = Hop(2e-6, 100e9), Hop(20e-6, 25e9 / 8)  # NVLink-ish; 25 Gbit/s
        >>> c = Cluster(nodes=2, per_node=8, intra=fast, inter=slow)
        >>> round(allreduce_s(100e6, c, "ring") * 1e3, 1)  # 30 steps of 20 us, 1.875 x 100 MB
        60.6
        >>> round(allreduce_s(100e6, c, "hierarchical") * 1e3, 1)  # 12.5 MB shards, 8 share a NIC
        33.8
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if cluster.workers <= 1:
        return 0.0
    if algorithm == "hierarchical" and cluster.nodes > 1 and cluster.per_node > 1:
        inside = 2 * collective_s("reduce_scatter", nbytes, cluster.per_node, cluster.intra)
        # The node's L shards cross at once: each gets nics / L of the node's bandwidth.
        shared = cluster.inter.scaled(cluster.nics / cluster.per_node)
        shard = nbytes / cluster.per_node
        across = min(collective_s(k, shard, cluster.nodes, shared) for k in ("ring", "tree"))
        return inside + across
    hop = cluster.inter.scaled(cluster.nics) if cluster.nodes > 1 else cluster.intra
    kinds = ("ring", "tree") if algorithm in ("nccl", "hierarchical") else (algorithm,)
    return min(collective_s(k, nbytes, cluster.workers, hop) for k in kinds)


@dataclass(frozen=True)
class ClusterLink:
    """An all-reduce on `cluster`, in the step model's form of a link (`seconds(nbytes)`)."""

    cluster: Cluster
    algorithm: str = "nccl"

    def seconds(self, nbytes: float) -> float:
        return allreduce_s(nbytes, self.cluster, self.algorithm)


@dataclass(frozen=True)
class ShareLink:
    """Hierarchical PowerSGD's messages between nodes, in the step model's form of a link.

    `seconds(nbytes)`: a bucket's `nbytes` (P, Q or the uncompressed, the whole
    node's) split into L shares, each all-reduced by one worker per node over
    the N nodes, all L at once on the node's NICs.

    Example:
        >>> c = Cluster(nodes=2, per_node=2, intra=Hop(1e-6, 1e10), inter=Hop(1e-4, 12.5e6))
        >>> round(ShareLink(c).seconds(1e6) * 1e3, 2)  # 0.5 MB a share, 2 steps, 6.25 MB/s each
        80.2
    """

    cluster: Cluster
    split: bool = True  # False: `nbytes` is one share's (a share of nothing sends nothing)

    def seconds(self, nbytes: float) -> float:
        c = self.cluster
        if c.nodes <= 1 or (not self.split and not nbytes):
            return 0.0
        hop = c.inter.scaled(c.nics / c.per_node)
        share = nbytes / c.per_node if self.split else nbytes
        return min(collective_s(k, share, c.nodes, hop) for k in ("ring", "tree"))


# The one grammar of a rate and a latency: the scale CLI's clusters and bandwidths,
# rank="auto"'s pinned link (config.parse_link) and the benchmark's cap (bench/netcap.py).
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_PER_SECOND = {"s": 1.0, "ms": 1e3, "us": 1e6, "ns": 1e9}
_NUMBER = r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
# "bit" in any case; bytes only as "B": a lone "b" ("1gb", tc's "mbps") is refused, not
# taken 8x off.
_RATE = re.compile(rf"\s*{_NUMBER}\s*([kmgtKMGT]?)([bB][iI][tT]|B)(?:/s)?\s*")
_LATENCY = re.compile(rf"\s*{_NUMBER}\s*(s|ms|us|ns)\s*")
CLUSTER_GRAMMAR = "NxL,intra=RATE/LATENCY,inter=RATE/LATENCY[,nics=K]"


def parse_rate(text: str) -> float:
    """Bytes per second from a rate: a number, an SI prefix (k, m, g, t), then "bit" (any
    case) or "B" (bytes), "/s" optional: "25gbit", "100Mbit/s", "12.5GB"; > 0.

    Example:
        >>> parse_rate("25gbit"), parse_rate("2GB"), parse_rate("1Gbit/s")
        (3125000000.0, 2000000000.0, 125000000.0)
    """
    match = _RATE.fullmatch(text)
    value = float(match[1]) * _UNITS[match[2].lower()] if match else 0.0
    if not 0 < value < math.inf:
        raise ValueError(f"expected a rate > 0 like '25gbit' or '12.5GB', got {text!r}")
    return value if match[3] == "B" else value / 8


def parse_latency(text: str) -> float:
    """Seconds from a latency: a number and s, ms, us or ns ("20us").

    Example:
        >>> parse_latency("20us"), parse_latency("2ms")
        (2e-05, 0.002)
    """
    match = _LATENCY.fullmatch(text)
    if not match:
        raise ValueError(f"expected a latency like '20us' (s, ms, us, ns), got {text!r}")
    return float(match[1]) / _PER_SECOND[match[2]]


def parse_hop(text: str) -> Hop:
    """A hop from "RATE/LATENCY", e.g. "25gbit/20us" (no latency: 0; a rate's own "/s"
    is no latency)."""
    rate, latency = text, "0us"
    head, slash, tail = text.rpartition("/")
    if slash and tail.strip() != "s":
        rate, latency = head, tail
    return Hop(parse_latency(latency), parse_rate(rate))


def parse_cluster(text: str) -> Cluster:
    """A cluster from `CLUSTER_GRAMMAR`: N nodes of L workers, the hop inside a node and the
    one between nodes (RATE/LATENCY, `parse_hop`), K NICs a node (1 unless given).

    A ValueError names the part that is wrong and gives the grammar.

    Example:
        >>> c = parse_cluster("4x8,intra=100GB/2us,inter=25gbit/20us,nics=2")
        >>> c.workers, c.inter.bytes_per_s, c.nics
        (32, 3125000000.0, 2)
    """
    shape, *parts = [part.strip() for part in text.split(",")]
    match = re.fullmatch(r"(\d+)x(\d+)", shape)
    if not match or int(match[1]) < 1 or int(match[2]) < 1:
        raise _wrong(shape, "expected NxL first, N nodes of L workers (integers >= 1)")
    values = {}
    for part in parts:
        name, equals, value = part.partition("=")
        if not equals or name not in ("intra", "inter", "nics"):
            raise _wrong(part, "expected intra=RATE/LATENCY, inter=RATE/LATENCY or nics=K")
        if name in values:
            raise _wrong(part, f"{name}= given twice")
        if name == "nics" and not (re.fullmatch(r"[0-9]+", value) and int(value) >= 1):
            raise _wrong(part, "expected K, the NICs a node, an integer >= 1")
        values[name] = int(value) if name == "nics" else _hop_of(part, value)
    missing = [name for name in ("intra", "inter") if name not in values]
    if missing:
        raise _wrong(text, f"no {missing[0]}= part")
    return Cluster(
        int(match[1]), int(match[2]), values["intra"], values["inter"], values.get("nics", 1)
    )


def _hop_of(part: str, value: str) -> Hop:
    try:
        return parse_hop(value)
    except ValueError as error:
        raise _wrong(part, str(error)) from None


def _wrong(part: str, problem: str) -> ValueError:
    """A cluster's bad `part`: what is wrong with it, then the whole grammar."""
    return ValueError(f"{part!r}: {problem}; a cluster is {CLUSTER_GRAMMAR}")
