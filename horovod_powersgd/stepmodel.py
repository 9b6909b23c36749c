"""One step of data-parallel training, modelled: the step rank="auto" plans with, the scale
CLI predicts from and bench/published checks against published clusters.

Pure: no torch, no Horovod. What a job's gradients send (`factor_sizes`, `message_bytes`),
what was measured of it (`Measurements`: a bucket's readiness in backward, its local work
and bytes at each rank, the link), and from those the step (`predict`), both schedules
(rounds=2: P then Q; rounds=1: one factor), flat PowerSGD or hierarchical (`hierarchical`:
one worker's share of a node's work, on a cluster's links):

* backward makes bucket b's gradients final `ready_s[b]` seconds after its
  first gradient (measured in plain steps); a bucket's compression runs on the
  same thread, in its hook, so it delays everything after it;
* a bucket leaves once it is final and compressed, and the link carries one
  all-reduce at a time, each taking `latency_s + bytes / bytes_per_s`
  (measured from this job's own all-reduces of its buckets, a `collectives.Hop`;
  on a cluster, `collectives.ClusterLink`); once backward is done and every first
  round is back, the rest of every bucket's local work runs, and with rounds=2
  every Q in one all-reduce (the reducer's order);
* hierarchical PowerSGD puts its node's collectives on the same link, one before
  a bucket's local work and one after its rounds: a worker's collectives run one
  at a time (Horovod's background thread on the CPU, its one NCCL stream on a GPU);
* the step ends when backward (plus the local work) and the link are both
  done; the rest of the step (forward, the optimizer) is what the measured
  plain step takes beyond the model's plain step.

planner.py chooses plans by this model (a job measured flat and run hierarchical:
`NodeSteps`); docs/auto.md and docs/scale.md give its equations and where it was checked.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from . import shares
from .collectives import Cluster, Hop, ShareLink, collective_s, per_link

PLAIN = 0
# The layout of a profile (`Measurements.to_dict`), written in its "format". A profile
# without "format" has this layout too: it was written before the field.
PROFILE_FORMAT = 1
# A profile is read (bench.scale) only where the model's plain step on the link it was
# measured on is within this band of its measured step (`Measurements.consistency`,
# predicted / measured). The 33 profiles taken on this machine's CPUs (docs/results/)
# give 0.875-1.323: the least where the fitted link misses part of the real one (two
# nodes), the most where it is slower than the real one (workers sharing cores). The
# two taken by one rank on an H200 before the tuner timed the device give 0.52 and 0.63
# on no link (1.61 and 1.27 on the link they fitted, which absorbed the device's lag).
CONSISTENT = (0.75, 1.5)


# A link that costs nothing: where one worker sends nothing (`Measurements.measured_on`).
FREE = Hop(latency_s=0.0, bytes_per_s=math.inf)


# --- what a step sends ------------------------------------------------------------------


def factor_sizes(shape: Sequence[int], rank: int, min_compression_rate: float):
    """(P, Q) elements of a gradient of `shape` sent as PowerSGD at `rank`, or None where
    it travels as it is: the one rule of what a gradient sends (the library's, the tuner's
    and the model's).

    The gradient is an n x m matrix (n its first dimension, m the product of the
    others) of rank r = min(rank, n, m): P is n x r, Q is m x r. It is compressed only
    where that shrinks it by `min_compression_rate`: n·m >= rate·r·(n + m); never with
    fewer than two dimensions, or none of size.

    Example:
        >>> factor_sizes((64, 32, 3, 3), 2, 2.0), factor_sizes((64,), 2, 2.0)
        ((128, 576), None)
    """
    if len(shape) < 2:
        return None
    n, m = shares.matrix(shape)
    if n == 0 or m == 0:
        return None
    r = min(rank, n, m)
    if n * m < min_compression_rate * r * (n + m):
        return None
    return r * n, r * m


def per_round(p: float, q: float, plain: float, rounds: int) -> tuple[float, float]:
    """(round 1, round 2) of a step that sends P, Q and the uncompressed `plain` (elements
    or bytes): with rounds=2, P and the uncompressed, then Q; with rounds=1, one factor
    a step, alternately, so the mean of the two, and the uncompressed, in one round.

    Example:
        >>> per_round(80, 40, 20, rounds=2), per_round(80, 40, 20, rounds=1)
        ((100, 40), (80.0, 0.0))
    """
    if rounds == 2:
        return p + plain, q
    return (p + q) / 2 + plain, 0.0


@dataclass(frozen=True)
class Tensor:
    """One gradient of a bucket, for predicting how a node shares it (`hierarchical`)."""

    numel: int
    element_bytes: int  # of the gradient (what the node's collectives carry)
    wire_bytes: float  # sent uncompressed: numel x the wire's element size
    factors: dict[int, tuple[float, float]] = field(default_factory=dict)  # rank -> (P, Q) bytes
    rows: int = 0  # its first dimension, the rows a node's split shares out (0: not known)
    dims: int = 0  # its number of dimensions (0: not known; with rows, 2 if it has columns)

    @property
    def shape(self) -> tuple[int, ...]:
        """A shape of its numel and rows, for `shares.split_of` (() where rows are not known;
        3-D where more than 2: not split by columns)."""
        if not self.rows:
            return ()
        dims = self.dims or (2 if self.numel != self.rows else 1)
        return (
            (self.rows,) if dims == 1 else (self.rows, self.numel // self.rows, *[1] * (dims > 2))
        )

    def block(self, width: int, kind: int) -> Tensor:
        """A block of `width` rows (kind `shares.SPLIT`) or columns (`SPLIT_COLUMNS`) of this
        tensor: its part of the elements and of the factor shared out (P by rows, Q by
        columns), all of the other (each block is its own rank-r matrix)."""
        rows, cols = shares.matrix(self.shape)
        part = width / (rows if kind == shares.SPLIT else cols)
        factors = {
            r: (p * part, q) if kind == shares.SPLIT else (p, q * part)
            for r, (p, q) in self.factors.items()
        }
        block_rows = width if kind == shares.SPLIT else rows
        return Tensor(round(self.numel * part), self.element_bytes, self.wire_bytes * part,
                      factors, block_rows, 2)  # fmt: skip


def message_bytes(tensors: Sequence[Tensor], rank: int, rounds: int) -> tuple[float, float]:
    """(round-1, round-2) bytes of these tensors as PowerSGD at `rank` (`per_round`).

    Example:
        >>> t = [Tensor(600, 4, 2400.0, {2: (80.0, 40.0)}), Tensor(10, 4, 40.0)]
        >>> message_bytes(t, 2, rounds=2), message_bytes(t, 2, rounds=1)
        ((120.0, 40.0), (100.0, 0.0))
    """
    p_bytes = sum(t.factors[rank][0] for t in tensors if rank in t.factors)
    q_bytes = sum(t.factors[rank][1] for t in tensors if rank in t.factors)
    plain = sum(t.wire_bytes for t in tensors if rank not in t.factors)
    return per_round(p_bytes, q_bytes, plain, rounds)


def bucket_bytes(tensors: Sequence[Tensor], ranks, rounds: int) -> dict[int, tuple[float, float]]:
    """rank -> (round-1 bytes, round-2 bytes) of a bucket's tensors as PowerSGD, at each of
    `ranks` that compresses any of them."""
    return {
        rank: message_bytes(tensors, rank, rounds)
        for rank in ranks
        if any(rank in t.factors for t in tensors)
    }


# --- what was measured ------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    """Bucket b sent as PowerSGD at one rank: its local work and its messages."""

    compress_s: float  # in the hooks, before the bucket can leave
    work_s: float  # all of its local work in a step (compress included)
    round1_bytes: float  # rounds=2: P and the uncompressed tensors; rounds=1: all of it
    round2_bytes: float = 0.0  # rounds=2: Q
    # Collectives on the same link before the local work, and after the rounds
    # (hierarchical PowerSGD's node stages, `hierarchical`; none for flat PowerSGD).
    before_s: float = 0.0
    after_s: float = 0.0


@dataclass(frozen=True)
class Bucket:
    """What a plain step of bucket b costs, and its PowerSGD options by rank."""

    ready_s: float
    plain_bytes: float
    options: dict[int, Option] = field(default_factory=dict)  # rank -> option
    tensors: tuple[Tensor, ...] = ()  # in bucket order (a profile's; () where not known)


@dataclass(frozen=True)
class Measurements:
    """Everything the model needs, measured in this job (the mean over its ranks)."""

    buckets: tuple[Bucket, ...]
    backward_s: float  # from the first gradient to the last, in a plain step
    step_s: float  # a whole plain step
    link: Hop  # the link to plan for
    rounds: int = 2
    # The step beyond the model's part (forward, the optimizer, the data): rank="auto"
    # measures it (the plain step less its first gradient to its last arrival). None:
    # the plain step less the modelled plain timeline on `link` (a synthetic profile).
    rest_s: float | None = None
    # How many workers the job ran on (None: not recorded). With one there was nothing
    # to send: `link` is Horovod's one-rank all-reduce (a copy and a cycle), not a link.
    workers: int | None = None
    compress_all = False  # a plain bucket is a choice (`NodeSteps`: it is not)

    def __post_init__(self):
        if self.rest_s is None:
            object.__setattr__(self, "rest_s", self._rest_on(self.link))

    def _rest_on(self, link) -> float:
        """The measured step less the model's plain timeline on `link` (at least 0)."""
        return max(self.step_s - _timeline(self, [PLAIN] * len(self.buckets), link), 0.0)

    def measured_on(self) -> Hop:
        """The link the job's all-reduces crossed: the fitted `link`, or a free one where
        the job ran on one worker (it sent nothing)."""
        return FREE if self.workers == 1 else self.link

    def consistency(self) -> float:
        """The model's plain step on the link the job was measured on (`measured_on`),
        over its measured `step_s`: whether the profile's parts add up to its own step.

        About 1 for a sound profile; `CONSISTENT` bounds it. Far below 1 where the
        backward window was the host's queueing of the device's work, not the device's
        (a CUDA profile from before the tuner timed the device): what the device still
        had to do lies in the wait for the last all-reduce, which the model takes for
        the link's and a faster link removes. Ask it of a profile as measured: its `link`
        is taken for the one it was measured on (`with_link` puts another there), and
        `scaled` leaves the link as it is. A `rest_s` of None was derived on `link` to
        make this 1 there (or above, where the modelled timeline alone exceeds the
        step): the check then says nothing unless `measured_on` is another link. Where
        one rank's fitted link absorbed the device's lag too, only `workers` (1) tells.

        Example:
            >>> b = Bucket(ready_s=0.01, plain_bytes=1e6)
            >>> lagging = Measurements((b,), 0.01, 0.04, Hop(0.02, 1e9), rest_s=0.01, workers=1)
            >>> round(lagging.consistency(), 2), lagging.corrected().consistency()
            (0.5, 1.0)
        """
        plain = [PLAIN] * len(self.buckets)
        return predict(self.with_link(self.measured_on()), plain) / self.step_s

    def corrected(self) -> Measurements:
        """The same job with `rest_s` such that its plain step on the link it was measured
        on is its measured step (no less than 0: where the modelled timeline alone is
        longer than the step, it stays longer and the profile stays inconsistent)."""
        return dataclasses.replace(self, rest_s=self._rest_on(self.measured_on()))

    def with_link(self, link) -> Measurements:
        """The same job planned for another link (the rest of the step as measured).

        `link`: anything with `seconds(nbytes)` for one all-reduce: a `Hop`, or a
        `collectives.ClusterLink` (the scale CLI's clusters).
        """
        return dataclasses.replace(self, link=link)

    def scaled(self, compute: float) -> Measurements:
        """The same job on a device where every second of local work takes `compute` s.

        Backward's timeline, the local work and the rest of the step scale alike
        (a GPU profile or a measured ratio of step times gives the factor).
        """

        def option(o: Option) -> Option:
            return dataclasses.replace(
                o, compress_s=o.compress_s * compute, work_s=o.work_s * compute
            )

        buckets = tuple(
            dataclasses.replace(
                b, ready_s=b.ready_s * compute, options={r: option(o) for r, o in b.options.items()}
            )
            for b in self.buckets
        )
        return dataclasses.replace(
            self,
            buckets=buckets,
            backward_s=self.backward_s * compute,
            step_s=self.step_s * compute,
            rest_s=self.rest_s * compute,
        )

    def to_dict(self) -> dict:
        """A JSON-ready profile of the job (`from_dict` reads it back), `PROFILE_FORMAT` in
        its "format"."""
        return {
            "format": PROFILE_FORMAT,
            "rounds": self.rounds,
            "backward_s": self.backward_s,
            "step_s": self.step_s,
            "rest_s": self.rest_s,
            **({} if self.workers is None else {"workers": self.workers}),
            "link": {"latency_s": self.link.latency_s, "bytes_per_s": self.link.bytes_per_s},
            "buckets": [
                {
                    "ready_s": b.ready_s,
                    "plain_bytes": b.plain_bytes,
                    "options": {str(r): dataclasses.asdict(o) for r, o in b.options.items()},
                    "tensors": [
                        [
                            t.numel,
                            t.element_bytes,
                            t.wire_bytes,
                            {str(r): f for r, f in t.factors.items()},
                            t.rows,
                            t.dims,
                        ]
                        for t in b.tensors
                    ],
                }
                for b in self.buckets
            ],
        }

    @staticmethod
    def from_dict(data: dict, rounds: int | None = None) -> Measurements:
        """The job back from a profile (`to_dict`'s, with the "trials" rank="auto" adds).

        The one check of a profile: a ValueError names the first field that is missing
        or out of range by its path ("buckets[3].ready_s: expected a finite number >= 0,
        got 'x'"). A "format" other than `PROFILE_FORMAT` is refused; a profile without
        one is read as this layout (it was written before the field).

        `rounds`: where given, a checkpoint's plan (rank="auto"'s state), read for the
        schedule the resumed job runs; a checkpoint written before it kept its
        measurements as a profile (lists, no schedule: `_from_checkpoint`) reads too.

        Example:
            >>> Measurements.from_dict({"format": 9, "rounds": 2})
            Traceback (most recent call last):
            ...
            ValueError: format: 9 is not supported (this version reads format 1, or none: ...)
        """
        data = _object(data, "the profile")
        if rounds is not None:
            if isinstance(data.get("link"), list):
                data = _from_checkpoint(data)
            data = {**data, "rounds": rounds}
        version = data.get("format", PROFILE_FORMAT)
        if not _is_integer(version) or version != PROFILE_FORMAT:
            raise ValueError(
                f"format: {_shown(version)} is not supported (this version reads format "
                f"{PROFILE_FORMAT}, or none: a profile from before the field)"
            )
        rounds = _field(data, "rounds", "", _integer)
        _expect(rounds in (1, 2), "rounds", "1 or 2", rounds)
        link = _field(data, "link", "", _object)
        listed = _field(data, "buckets", "", _list)
        _expect(listed, "buckets", "at least one bucket", listed)
        buckets = tuple(_bucket(b, f"buckets[{i}]") for i, b in enumerate(listed))
        for i, trial in enumerate(_field(data, "trials", "", _list, [])):
            path = f"trials[{i}]"
            _field(_object(trial, path), "step_s", path, _positive)
            # Its timed steps: in profiles since auto weighs the trials' noise (none before).
            for j, step in enumerate(_field(trial, "steps_s", path, _list, [])):
                _positive(step, f"{path}.steps_s[{j}]")
            plan = _field(trial, "plan", path, _list)
            ok = len(plan) == len(buckets) and all(_is_integer(r) and r >= 0 for r in plan)
            _expect(ok, f"{path}.plan", f"a rank >= 0 for each of the {len(buckets)} buckets", plan)
        return Measurements(
            buckets,
            _field(data, "backward_s", "", _number),
            _field(data, "step_s", "", _positive),
            Hop(
                _field(link, "latency_s", "link", _number),
                _field(link, "bytes_per_s", "link", _rate),
            ),
            rounds,
            _field(data, "rest_s", "", _number),
            _field(data, "workers", "", _integer, None),
        )


def _from_checkpoint(state: dict) -> dict:
    """rank="auto"'s measurements as checkpoints held them before they were kept as a
    profile, in a profile's layout: each bucket [ready_s, plain_bytes, [[rank, *the
    Option's fields], ...]], the link [latency_s, bytes_per_s] (no tensors, no workers)."""
    fields = [f.name for f in dataclasses.fields(Option)]
    return {
        "backward_s": state["backward_s"],
        "step_s": state["step_s"],
        "rest_s": state["rest_s"],
        "link": dict(zip(("latency_s", "bytes_per_s"), state["link"])),
        "buckets": [
            {
                "ready_s": ready,
                "plain_bytes": plain,
                "options": {str(r): dict(zip(fields, option)) for r, *option in options},
            }
            for ready, plain, options in state["buckets"]
        ],
    }


# Reading a profile back (`Measurements.from_dict`): each reader takes a JSON value and
# its path in the profile, and returns the value or raises a ValueError naming the path.


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _expect(ok: bool, path: str, expected: str, value) -> None:
    if not ok:
        raise ValueError(f"{path}: expected {expected}, got {_shown(value)}")


def _is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON's true is no count


def _is_real(value) -> bool:
    """A JSON number Python can take as a float (NaN and the infinities included)."""
    return isinstance(value, float) or (_is_integer(value) and abs(value) <= sys.float_info.max)


def _field(data: dict, key: str, path: str, read, default=dataclasses.MISSING):
    """`data[key]` through `read`; where missing, `default`, or a ValueError naming it."""
    here = f"{path}.{key}" if path else key
    if key in data:
        return read(data[key], here)
    if default is dataclasses.MISSING:
        raise ValueError(f"{here}: missing")
    return default


def _object(value, path: str) -> dict:
    _expect(isinstance(value, dict), path, "a JSON object", value)
    return value


def _list(value, path: str) -> list:
    _expect(isinstance(value, list), path, "a list", value)
    return value


def _integer(value, path: str) -> int:
    _expect(_is_integer(value) and value >= 1, path, "an integer >= 1", value)
    return value


def _number(value, path: str) -> float:
    """Seconds or bytes: finite, >= 0 (NaN is neither)."""
    ok = _is_real(value) and math.isfinite(value) and value >= 0
    _expect(ok, path, "a finite number >= 0", value)
    return float(value)


def _positive(value, path: str) -> float:
    ok = _is_real(value) and math.isfinite(value) and value > 0
    _expect(ok, path, "a finite number > 0", value)
    return float(value)


def _rate(value, path: str) -> float:
    """Bytes per second: > 0; Infinity where the fit found no cost per byte (`Hop.fit`)."""
    _expect(_is_real(value) and value > 0, path, "a number > 0 (or Infinity)", value)
    return float(value)


def _ranks(value, path: str, read) -> dict:
    """A JSON object of rank (its keys, as text) -> value, each through `read`."""
    out = {}
    for key, item in _object(value, path).items():
        rank = key.isascii() and key.isdigit() and int(key) >= 1
        _expect(rank, f"{path} key", "a rank >= 1", key)
        out[int(key)] = read(item, f"{path}.{key}")
    return out


def _option(value, path: str) -> Option:
    data = _object(value, path)
    fields = dataclasses.fields(Option)  # the later ones have defaults: older profiles lack them
    return Option(**{f.name: _field(data, f.name, path, _number, f.default) for f in fields})


def _factors(value, path: str) -> tuple[float, float]:
    pair = isinstance(value, (list, tuple)) and len(value) == 2  # a tuple: `to_dict`'s own
    _expect(pair, path, "[P bytes, Q bytes]", value)
    return _number(value[0], f"{path}[0]"), _number(value[1], f"{path}[1]")


def _tensor(value, path: str) -> Tensor:
    # rows and dims: not in older profiles
    shape = isinstance(value, list) and 4 <= len(value) <= 6
    _expect(shape, path, "[numel, element bytes, wire bytes, {rank: [P, Q]}, rows, dims]", value)
    numel, element_bytes, wire_bytes, factors, *more = value
    _expect(_is_integer(numel) and numel >= 0, f"{path}[0]", "an integer >= 0", numel)
    more = [*more, 0, 0][:2]
    for i, x in enumerate(more):
        _expect(_is_integer(x) and x >= 0, f"{path}[{4 + i}]", "an integer >= 0", x)
    return Tensor(
        numel,
        _integer(element_bytes, f"{path}[1]"),
        _number(wire_bytes, f"{path}[2]"),
        _ranks(factors, f"{path}[3]", _factors),
        *more,
    )


def _bucket(value, path: str) -> Bucket:
    data = _object(value, path)
    tensors = _field(data, "tensors", path, _list, [])  # none in profiles before their sizes
    return Bucket(
        _field(data, "ready_s", path, _number),
        _field(data, "plain_bytes", path, _number),
        _ranks(_field(data, "options", path, _object), f"{path}.options", _option),
        tuple(_tensor(t, f"{path}.tensors[{i}]") for i, t in enumerate(tensors)),
    )


# --- the step ---------------------------------------------------------------------------


def _timeline(m: Measurements, plan: Sequence[int], on=None) -> float:
    """Seconds from the first gradient until both the hooks' work and the link are done,
    on the link `on` (`m.link` where None).

    Flat PowerSGD as the reducer orders a step (reducer.py): each bucket's compression
    in its hook, delaying the backward pass behind it, and its first round as soon as
    the link is free; after backward, once every first round is back, the rest of every
    bucket's local work (rounds=2: the projection of all, every Q in one all-reduce,
    the error update beside it, then the decompression), which nothing overlaps.
    Hierarchical PowerSGD (options with node stages) takes each bucket's stages in turn,
    its Q right after its P (`_stages`).
    """
    options = [b.options.get(r) for b, r in zip(m.buckets, plan) if r != PLAIN]
    if any(o is not None and (o.before_s or o.after_s) for o in options):
        return _stages(m, plan, on)
    link_s = (m.link if on is None else on).seconds
    shift = 0.0  # local work done in the hooks so far: it delays what follows
    link = 0.0  # the link is busy until then
    after, q_bytes = 0.0, 0.0  # the local work after backward; rounds=2's Q round
    for bucket, rank in zip(m.buckets, plan):
        option = bucket.options.get(rank) if rank != PLAIN else None
        if option is None:
            link = max(bucket.ready_s + shift, link) + link_s(bucket.plain_bytes)
            continue
        shift += option.compress_s
        link = max(bucket.ready_s + shift, link) + link_s(option.round1_bytes)
        after += option.work_s - option.compress_s
        q_bytes += option.round2_bytes if m.rounds == 2 else 0.0
    end = max(m.backward_s + shift, link)  # every first round back
    return end + after + (link_s(q_bytes) if q_bytes else 0.0)


def _stages(m: Measurements, plan: Sequence[int], on=None) -> float:
    """`_timeline` of hierarchical PowerSGD: each bucket's node stage, local work and
    rounds in turn on the worker's one queue of collectives."""
    link_s = (m.link if on is None else on).seconds
    shift = 0.0  # local work done in the hooks so far: it delays what follows
    link = 0.0  # the link is busy until then
    for bucket, rank in zip(m.buckets, plan):
        option = bucket.options.get(rank) if rank != PLAIN else None
        if option is None:
            link = max(bucket.ready_s + shift, link) + link_s(bucket.plain_bytes)
            continue
        leaves = bucket.ready_s + shift + option.compress_s
        if option.before_s:  # the local work waits for the link's collective before it
            link = max(bucket.ready_s + shift, link) + option.before_s
            leaves = link + option.compress_s
        shift += option.work_s
        link = max(leaves, link) + link_s(option.round1_bytes)
        if m.rounds == 2 and option.round2_bytes:
            link += link_s(option.round2_bytes)
        link += option.after_s
    return max(m.backward_s + shift, link)


def predict(m: Measurements | NodeSteps, plan: Sequence[int]) -> float:
    """The expected step time of `plan`, in seconds: the measured rest of the step, and
    the modelled timeline from the first gradient to the last arrival (hierarchical:
    the slowest share's, `NodeSteps`)."""
    if isinstance(m, NodeSteps):
        return max(predict(share, plan) for share in m.shares)
    return m.rest_s + _timeline(m, plan)


def uniform(m: Measurements, rank: int) -> list[int]:
    """Every bucket at `rank` (plain where it has nothing to compress at that rank)."""
    return [rank if rank in bucket.options else PLAIN for bucket in m.buckets]


# --- hierarchical PowerSGD ---------------------------------------------------------------


def hierarchical(m: Measurements, cluster) -> list[Measurements]:
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
    pieces = _pieces(m.buckets, per_node)
    stages = [_node_stages(tensors, owner, cluster) for tensors, owner in pieces]
    out = []
    for j in range(per_node):
        buckets = []
        for b, (tensors, owner), (before, after) in zip(m.buckets, pieces, stages):
            mine = [t for t, k in zip(tensors, owner) if k == j]
            options = {}
            for r in ranks:
                compressed = sum(t.numel for t in tensors if r in t.factors)
                part = (
                    sum(t.numel for t in mine if r in t.factors) / compressed if compressed else 0
                )
                o = b.options.get(r, Option(0.0, 0.0, 0.0))
                first, second = message_bytes(mine, r, m.rounds)
                options[r] = Option(
                    o.compress_s * part, o.work_s * part, first, second, before, after
                )
            buckets.append(dataclasses.replace(b, options=options))
        out.append(dataclasses.replace(m, buckets=tuple(buckets), link=ShareLink(cluster, False)))
    return out


@dataclass(frozen=True)
class NodeSteps:
    """A job measured flat (rank="auto"'s `Measurements`: its all-reduces timed over all
    `workers`) planned as hierarchical PowerSGD on nodes of `per_node` workers, the
    node's link timed as `intra` (an all-reduce over the node, `collectives.per_link`
    turns both into hops). The planner plans it as a `Measurements`: its `buckets` say
    which ranks each bucket can take, `predict` gives its step (the slowest share's,
    `hierarchical`), `with_link` puts another link between the nodes. Every bucket
    that can be compressed is (`compress_all`): a plain bucket's stages are not in the
    model.
    """

    flat: Measurements
    per_node: int
    intra: Hop  # the node's all-reduce, as timed
    compress_all = True

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        return self.flat.buckets

    @functools.cached_property
    def cluster(self) -> Cluster:
        workers = self.flat.workers or self.per_node
        nodes = max(workers // self.per_node, 1)
        inter = per_link(self.flat.link, workers)
        return Cluster(nodes, self.per_node, per_link(self.intra, self.per_node), inter)

    @functools.cached_property
    def shares(self) -> list[Measurements]:
        return hierarchical(self.flat, self.cluster)

    def with_link(self, link: Hop) -> NodeSteps:
        return dataclasses.replace(self, flat=self.flat.with_link(link))


def _pieces(buckets, per_node: int) -> list[tuple[list[Tensor], list[int]]]:
    """Per bucket, its tensors as the node shares them (`shares.owners`): a split one as
    its L blocks, and each piece's owner. A tensor of unknown rows (a profile from before
    they were recorded) is not split."""
    sizes = [[t.numel for t in b.tensors] for b in buckets]
    shapes = [[t.shape for t in b.tensors] for b in buckets]
    out = []
    for b, owner in zip(buckets, shares.owners(sizes, per_node, shapes)):
        tensors, owners = [], []
        for t, j in zip(b.tensors, owner):
            if j >= 0:
                tensors.append(t)
                owners.append(j)
                continue
            dim = 0 if j == shares.SPLIT else 1
            for k, (start, stop) in enumerate(shares.blocks(t.shape[dim], per_node)):
                tensors.append(t.block(stop - start, j))
                owners.append(k)
        out.append((tensors, owners))
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


def _even_shares(m: Measurements, cluster, ranks) -> Measurements:
    """A profile without tensor sizes: every bucket split into L equal shares."""
    per_node = cluster.per_node

    def stage(kind: str, nbytes: float) -> float:
        return collective_s(kind, nbytes, per_node, cluster.intra)

    buckets = []
    for b in m.buckets:
        before, after = stage("reduce_scatter", b.plain_bytes), stage("all_gather", b.plain_bytes)
        options = {}
        for r in ranks:
            o = b.options.get(r, Option(0.0, 0.0, b.plain_bytes))
            options[r] = dataclasses.replace(
                o,
                compress_s=o.compress_s / per_node,
                work_s=o.work_s / per_node,
                before_s=before,
                after_s=after,
            )
        buckets.append(dataclasses.replace(b, options=options))
    return dataclasses.replace(m, buckets=tuple(buckets), link=ShareLink(cluster))


def hierarchical_s(m: Measurements, cluster, rank: int) -> float:
    """Predicted seconds of a hierarchical PowerSGD step at `rank`: the slowest share's."""
    return max(predict(s, uniform(s, rank)) for s in hierarchical(m, cluster))


def compute_under_compression(m: Measurements, trials: list[dict]) -> float | None:
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
        >>> o = Option(compress_s=0.0, work_s=0.0, round1_bytes=1e3)
        >>> b = Bucket(ready_s=0.5, plain_bytes=1e8, options={2: o})
        >>> m = Measurements((b,), 0.5, 2.0, Hop(0.0, 1e9), rest_s=0.5)
        >>> round(compute_under_compression(m, [{"plan": [2], "step_s": 1.5}]), 3)
        1.5
    """
    bytes_only = m.with_link(Hop(0.0, m.link.bytes_per_s))

    def step(factor: float, plan) -> float:
        return predict(bytes_only.scaled(factor), plan)

    factors = []
    for trial in trials:
        plan, measured = trial["plan"], trial["step_s"]
        if not any(plan) or any(r == PLAIN and b.options for r, b in zip(plan, m.buckets)):
            continue  # a plain bucket's all-reduce: the link's time, not the compute's
        low, high = 0.05, 20.0
        if not step(low, plan) <= measured <= step(high, plan):
            continue
        for _ in range(60):
            mid = (low * high) ** 0.5
            low, high = (mid, high) if step(mid, plan) < measured else (low, mid)
        factors.append((low * high) ** 0.5)
    return statistics.median(factors) if factors else None
