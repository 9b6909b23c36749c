"""rank="auto": which buckets to compress, and at which rank, from measurements of this job.

Pure: no Horovod and no tensor math. `tuner.py` measures, asks here, and
applies the answer. A plan gives every bucket (the reducer's unit of
communication, in the order backward produces them) a rank: 0 sends it as the
user's `compression` does (plain), r >= 1 sends its compressible tensors as
PowerSGD factors of rank r.

The model of one step, from what was measured in this job:

* backward makes bucket b's gradients final `ready_s[b]` seconds after its
  first gradient (measured in plain steps); PowerSGD's local work runs on the
  same thread, in the hooks, so it delays everything after it;
* a bucket leaves once it is final and compressed, and the link carries one
  all-reduce at a time, each taking `latency_s + bytes / bytes_per_s`
  (measured from this job's own all-reduces of its buckets); with rounds=2 the
  Q round follows the P round and its projection;
* hierarchical PowerSGD (bench/scale.py) puts its node's collectives on the
  same link, one before a bucket's local work and one after its rounds: a
  worker's collectives run one at a time (Horovod's background thread on the
  CPU, its one NCCL stream on a GPU);
* the step ends when backward (plus the local work) and the link are both
  done; the rest of the step (forward, the optimizer) is what the measured
  plain step takes beyond the model's plain step.

`choose` minimises that over per-bucket ranks (coordinate descent from every
uniform plan), then, among plans within `tolerance` of the shortest, takes
the preferred one: plain, then the lowest rank, bucket by bucket. The model is
only a guide: the tuner measures the real step time of a few `candidates`
before it settles, and `pick_measured` takes the preferred of those measured
within the trials' noise (`margin`) of the fastest.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class Link:
    """An all-reduce of `n` bytes takes `latency_s + n / bytes_per_s`."""

    latency_s: float
    bytes_per_s: float

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s

    @staticmethod
    def fit(samples: Sequence[tuple[float, float]]) -> Link:
        """Least squares over (bytes, seconds) of timed all-reduces; the latency >= 0.

        Example:
            >>> link = Link.fit([(1e3, 0.01001), (1e6, 0.02), (4e6, 0.05)])
            >>> round(link.latency_s, 3), round(link.bytes_per_s / 1e6)
            (0.01, 100)
        """
        if not samples:
            raise ValueError("no timed all-reduce to fit the link to")
        xs, ys = [float(b) for b, _ in samples], [float(s) for _, s in samples]
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        spread = sum((x - mean_x) ** 2 for x in xs)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread if spread else 0
        if slope <= 0:  # all of one size, or no cost per byte: all of it is latency
            return Link(latency_s=max(mean_y, 0.0), bytes_per_s=math.inf)
        latency = max(mean_y - slope * mean_x, 0.0)
        return Link(latency_s=latency, bytes_per_s=1.0 / slope)


# A link that costs nothing: where one worker sends nothing (`Measurements.measured_on`).
FREE = Link(latency_s=0.0, bytes_per_s=math.inf)


@dataclass(frozen=True)
class Option:
    """Bucket b sent as PowerSGD at one rank: its local work and its messages."""

    compress_s: float  # in the hooks, before the bucket can leave
    work_s: float  # all of its local work in a step (compress included)
    round1_bytes: float  # rounds=2: P and the uncompressed tensors; rounds=1: all of it
    round2_bytes: float = 0.0  # rounds=2: Q
    # Collectives on the same link before the local work, and after the rounds
    # (hierarchical PowerSGD's node stages, bench/scale.py; none for flat PowerSGD).
    before_s: float = 0.0
    after_s: float = 0.0


@dataclass(frozen=True)
class Tensor:
    """One gradient of a bucket, for predicting how a node shares it (bench/scale.py)."""

    numel: int
    element_bytes: int  # of the gradient (what the node's collectives carry)
    wire_bytes: float  # sent uncompressed: numel x the wire's element size
    factors: dict[int, tuple[float, float]] = field(default_factory=dict)  # rank -> (P, Q) bytes


def message_bytes(tensors: Sequence[Tensor], rank: int, rounds: int) -> tuple[float, float]:
    """(round-1, round-2) bytes of these tensors as PowerSGD at `rank`: with rounds=2, P
    and the uncompressed tensors, then Q; with rounds=1, one factor (half of P and Q,
    alternating) and the uncompressed tensors.

    Example:
        >>> t = [Tensor(600, 4, 2400.0, {2: (80.0, 40.0)}), Tensor(10, 4, 40.0)]
        >>> message_bytes(t, 2, rounds=2), message_bytes(t, 2, rounds=1)
        ((120.0, 40.0), (100.0, 0.0))
    """
    p_bytes = sum(t.factors[rank][0] for t in tensors if rank in t.factors)
    q_bytes = sum(t.factors[rank][1] for t in tensors if rank in t.factors)
    plain = sum(t.wire_bytes for t in tensors if rank not in t.factors)
    if rounds == 2:
        return p_bytes + plain, q_bytes
    return (p_bytes + q_bytes) / 2 + plain, 0.0


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
    link: Link  # the link to plan for
    rounds: int = 2
    # The step beyond the model's part (forward, the optimizer, the data): rank="auto"
    # measures it (the plain step less its first gradient to its last arrival). None:
    # the plain step less the modelled plain timeline on `link` (a synthetic profile).
    rest_s: float | None = None
    # How many workers the job ran on (None: not recorded). With one there was nothing
    # to send: `link` is Horovod's one-rank all-reduce (a copy and a cycle), not a link.
    workers: int | None = None

    def __post_init__(self):
        if self.rest_s is None:
            object.__setattr__(self, "rest_s", self._rest_on(self.link))

    def _rest_on(self, link) -> float:
        """The measured step less the model's plain timeline on `link` (at least 0)."""
        return max(self.step_s - _timeline(self, [PLAIN] * len(self.buckets), link), 0.0)

    def measured_on(self) -> Link:
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
            >>> lagging = Measurements((b,), 0.01, 0.04, Link(0.02, 1e9), rest_s=0.01, workers=1)
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

        `link`: anything with `seconds(nbytes)` for one all-reduce: a `Link`, or a
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
                        ]
                        for t in b.tensors
                    ],
                }
                for b in self.buckets
            ],
        }

    @staticmethod
    def from_dict(data: dict) -> Measurements:
        """The job back from a profile (`to_dict`'s, with the "trials" rank="auto" adds).

        The one check of a profile: a ValueError names the first field that is missing
        or out of range by its path ("buckets[3].ready_s: expected a finite number >= 0,
        got 'x'"). A "format" other than `PROFILE_FORMAT` is refused; a profile without
        one is read as this layout (it was written before the field).

        Example:
            >>> Measurements.from_dict({"format": 9, "rounds": 2})
            Traceback (most recent call last):
            ...
            ValueError: format: 9 is not supported (this version reads format 1, or none: ...)
        """
        data = _object(data, "the profile")
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
            Link(
                _field(link, "latency_s", "link", _number),
                _field(link, "bytes_per_s", "link", _rate),
            ),
            rounds,
            _field(data, "rest_s", "", _number),
            _field(data, "workers", "", _integer, None),
        )


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
    """Bytes per second: > 0; Infinity where the fit found no cost per byte (`Link.fit`)."""
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
    shape = isinstance(value, list) and len(value) == 4
    _expect(shape, path, "[numel, element bytes, wire bytes, {rank: [P, Q]}]", value)
    numel, element_bytes, wire_bytes, factors = value
    _expect(_is_integer(numel) and numel >= 0, f"{path}[0]", "an integer >= 0", numel)
    return Tensor(
        numel,
        _integer(element_bytes, f"{path}[1]"),
        _number(wire_bytes, f"{path}[2]"),
        _ranks(factors, f"{path}[3]", _factors),
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


def _timeline(m: Measurements, plan: Sequence[int], on=None) -> float:
    """Seconds from the first gradient until both the hooks' work and the link are done,
    on the link `on` (`m.link` where None)."""
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


def predict(m: Measurements, plan: Sequence[int]) -> float:
    """The expected step time of `plan`, in seconds: the measured rest of the step, and
    the modelled timeline from the first gradient to the last arrival."""
    return m.rest_s + _timeline(m, plan)


def _accuracy(rank: int) -> float:
    """Higher is closer to the exact average: plain, then the highest rank."""
    return math.inf if rank == PLAIN else rank


def _preference(rank: int) -> float:
    """Higher is preferred where plans are as fast: plain (the exact average, and nothing
    to gain from compressing), then the lowest rank (the fewest bytes on the wire)."""
    return math.inf if rank == PLAIN else -rank


def _choices(bucket: Bucket) -> list[int]:
    return [PLAIN, *sorted(bucket.options)]


def _descend(m: Measurements, plan: list[int], passes: int = 3) -> tuple[list[int], float]:
    """Coordinate descent: each bucket's fastest choice given the others', until stable."""
    best = predict(m, plan)
    for _ in range(passes):
        moved = False
        for b, bucket in enumerate(m.buckets):
            for rank in _choices(bucket):
                trial = [*plan[:b], rank, *plan[b + 1 :]]
                seconds = predict(m, trial)
                if seconds < best - 1e-12:
                    plan, best, moved = trial, seconds, True
        if not moved:
            break
    return plan, best


def uniform(m: Measurements, rank: int) -> list[int]:
    """Every bucket at `rank` (plain where it has nothing to compress at that rank)."""
    return [rank if rank in bucket.options else PLAIN for bucket in m.buckets]


def fastest(m: Measurements, ladder: Sequence[int]) -> tuple[list[int], float]:
    """The plan of the shortest predicted step (descent from every uniform plan)."""
    results = [_descend(m, uniform(m, rank)) for rank in (PLAIN, *ladder)]
    return min(results, key=lambda result: result[1])


def preferred_within(m: Measurements, plan: Sequence[int], budget_s: float) -> list[int]:
    """`plan` with each bucket moved to its preferred choice (plain, then the lowest rank)
    that keeps the predicted step <= budget, bucket by bucket."""
    plan = list(plan)
    for b, bucket in enumerate(m.buckets):
        for rank in sorted(_choices(bucket), key=_preference, reverse=True):
            if _preference(rank) <= _preference(plan[b]):
                break
            trial = [*plan[:b], rank, *plan[b + 1 :]]
            if predict(m, trial) <= budget_s:
                plan = trial
                break
    return plan


def choose(m: Measurements, ladder: Sequence[int], tolerance: float = 0.03) -> list[int]:
    """The plan: the preferred among those within `tolerance` of the shortest step (plain,
    then the lowest rank, bucket by bucket).

    Example:
        >>> fast = Link(latency_s=1e-4, bytes_per_s=1e10)
        >>> option = Option(compress_s=0.002, work_s=0.005, round1_bytes=1e4, round2_bytes=1e4)
        >>> b = Bucket(ready_s=0.05, plain_bytes=4e6, options={2: option})
        >>> m = Measurements((b,), backward_s=0.05, step_s=0.1, link=fast)
        >>> choose(m, [2]), choose(m.with_link(Link(1e-3, 6.25e6)), [2])  # 10 Gbit/s, 50 Mbit/s
        ([0], [2])
    """
    plan, shortest = fastest(m, ladder)
    return preferred_within(m, plan, shortest * (1 + tolerance))


# A plan the model expects this many times slower than its choice is not tried:
# the model has been off by up to 1.5x on a loaded 2-core machine, never by 3x,
# and trying plain on a slow link costs steps many times as long.
HOPELESS = 3.0


def candidates(m: Measurements, ladder: Sequence[int], tolerance: float = 0.03) -> list[list[int]]:
    """Plans worth timing for real: the model's choice, plain, the two best uniform ones
    (those the model expects at most `HOPELESS` times slower than its choice)."""
    chosen = choose(m, ladder, tolerance)
    limit = HOPELESS * predict(m, chosen)
    uniforms = sorted((uniform(m, r) for r in ladder), key=lambda plan: predict(m, plan))
    out: list[list[int]] = []
    for plan in (chosen, uniform(m, PLAIN), *uniforms[:2]):
        if plan not in out and predict(m, plan) <= limit:
            out.append(plan)
    return out


# A plan counts as faster than another only where a one-sided test at this level says so
# (`margin`): were the two as fast, with normal errors, it would be measured that much
# faster in one comparison in 10^4, whatever the number of steps its noise is known from.
NOISE_ALPHA = 1e-4
# Student's t at 1 - NOISE_ALPHA by degrees of freedom, 1 to 30 (more take 30's, a little
# above theirs): the t where betainc(df / 2, 1 / 2, 0, df / (df + t^2), regularized) / 2
# is NOISE_ALPHA (mpmath, bisection), rounded up to 0.01 (tests/unit/test_planner.py
# integrates the tail again).
T_QUANTILE = (
    3183.1, 70.71, 22.21, 13.04, 9.68, 8.03, 7.07, 6.45, 6.02, 5.7, 5.46, 5.27, 5.12, 4.99, 4.88,
    4.8, 4.72, 4.65, 4.59, 4.54, 4.5, 4.46, 4.42, 4.39, 4.36, 4.33, 4.3, 4.28, 4.26, 4.24,
)  # fmt: skip


def margin(groups: Sequence[Sequence[float]], steps: int, tolerance: float = 0.03) -> float:
    """How much faster than another a timed plan must be measured to count as faster,
    relative: the larger of `tolerance` and the trials' noise, the standard error of the
    difference between two plans' mean steps over `steps` timed steps each, times Student's
    t at 1 - NOISE_ALPHA (`T_QUANTILE`: the spread is estimated from few steps).

    The spread of one step comes from `groups` (each the step times of one plan; the
    non-finite ones left out), pooled about each group's own mean relative to it: the
    step's jitter, not the plans' differences. Where no group has two steps, `tolerance`.

    Example:
        >>> plain, compressed = [1.00, 1.10, 0.90, 1.00], [0.95, 1.05, 0.85, 0.95]
        >>> round(margin([plain, compressed], steps=4), 3)  # 8.03 x 8.4 % x (2 / 4) ** 0.5
        0.476
    """
    squares, freedom = 0.0, 0
    for group in groups:
        times = [t for t in group if math.isfinite(t)]
        if len(times) < 2:
            continue
        mean = sum(times) / len(times)
        squares += sum((t / mean - 1) ** 2 for t in times)
        freedom += len(times) - 1
    if not freedom:
        return tolerance
    t = T_QUANTILE[min(freedom, len(T_QUANTILE)) - 1]
    return max(tolerance, t * math.sqrt(squares / freedom) * math.sqrt(2 / steps))


def pick_measured(
    plans: Sequence[Sequence[int]],
    steps: Sequence[Sequence[float]],
    tolerance: float = 0.03,
    spread: Sequence[Sequence[float]] = (),
) -> tuple[list[int], float]:
    """Of plans timed for real (`steps`: each plan's timed step times), the preferred of
    those whose mean step is within the `margin` of the fastest: the one with the most
    plain buckets, then the lowest ranks (their sum), then the faster. Returns the plan
    and the margin.

    The margin is the larger of `tolerance` and the trials' noise, from the spread of
    `steps` and of `spread` (more groups of steps of one plan each, e.g. the plain steps
    measured before the trials). So plain stays unless a compressed plan was measured
    faster than it by more than the noise, a bucket stays plain where a plan that sends it
    plain is as fast, and of the compressed plans as fast as the fastest, the one of the
    lowest ranks is taken.

    Example:
        >>> plans = [[0, 0], [1, 1], [2, 2]]
        >>> steps = [[1.00, 1.10, 0.90, 1.00], [0.95, 1.05, 0.85, 0.95], [2.0, 2.1, 1.9, 2.0]]
        >>> plan, noise = pick_measured(plans, steps)  # rank 1: 5 % faster, in 31 % noise
        >>> plan, round(noise, 2)
        ([0, 0], 0.31)
    """
    seconds = [sum(g) / len(g) for g in steps]
    noise = margin([*spread, *steps], min(len(g) for g in steps), tolerance)
    shortest = min(seconds)
    near = [(list(p), s) for p, s in zip(plans, seconds) if s <= shortest * (1 + noise)]

    def preference(timed):
        plan, s = timed
        return sum(r == PLAIN for r in plan), -sum(plan), -s

    return max(near, key=preference)[0], noise


def raise_failing(
    m: Measurements, plan: Sequence[int], failing: Sequence[int], budget_s: float
) -> list[int]:
    """`plan` with each failing bucket (its approximation fails) one step more accurate,
    where the step stays within `budget_s`."""
    plan = list(plan)
    for b in failing:
        more = [r for r in _choices(m.buckets[b]) if _accuracy(r) > _accuracy(plan[b])]
        for rank in sorted(more, key=_accuracy):
            trial = [*plan[:b], rank, *plan[b + 1 :]]
            if predict(m, trial) <= budget_s:
                plan = trial
            break
    return plan
