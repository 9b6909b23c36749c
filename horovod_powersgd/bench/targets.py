"""What the benchmark promises, and how a target is judged from records (pure, no timing).

A target compares two configurations of the same model at the same link. When both ran in
one paired job (``Record.round_ms``), the ratio is the median of per-round ratios with an
order-statistic interval (confidence.py) and the verdict is ``hit``, ``missed`` or
``not resolved``; records of separate jobs give a ratio of medians and no interval.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from . import confidence
from .confidence import Interval
from .configs import RANKED
from .stats import Record

# (model, rank, description, numerator config, denominator config, bandwidth, upper limit)
TIME_TARGETS = (
    # the two-round step against torch's hook, no communication and plain Horovod
    ("resnet18", 2, "PowerSGD / torch DDP powerSGD_hook", "powersgd", "ddp-powersgd", "200mbit", 0.9),  # noqa: E501
    ("resnet18", 2, "PowerSGD / torch DDP powerSGD_hook", "powersgd", "ddp-powersgd", "1gbit", 0.9),
    ("resnet18", 2, "PowerSGD / local (no communication)", "powersgd", "local", "200mbit", 1.1),
    ("resnet18", 2, "PowerSGD / plain Horovod", "powersgd", "horovod", "unlimited", 1.1),
    # the one-round step
    ("resnet18", 2, "1-round / local", "powersgd-1round", "local", "50mbit", 1.05),
    ("resnet18", 2, "1-round / 2-round", "powersgd-1round", "powersgd", "50mbit", 0.92),
    ("lstm", 4, "1-round / local", "powersgd-1round", "local", "50mbit", 1.05),
    ("lstm", 4, "1-round / torch powerSGD_hook", "powersgd-1round", "ddp-powersgd", "200mbit", 1.0),
    # per-layer statistics on (the default) / off
    ("resnet18", 2, "statistics on / off", "powersgd", "powersgd-nostats", "unlimited", 1.01),
    ("lstm", 4, "statistics on / off", "powersgd", "powersgd-nostats", "unlimited", 1.02),
    # a model of 300 distinct layer shapes
    ("manyshapes", 2, "PowerSGD / plain Horovod", "powersgd", "horovod", "unlimited", 1.5),
    ("manyshapes", 2, "1-round / plain Horovod", "powersgd-1round", "horovod", "unlimited", 1.5),
    # rounds=2: every Q in one grouped all-reduce, against each alone as its P comes back
    # (bench/ablation.py): no slower (100mbit: the two-node ground)
    ("resnet18", 2, "grouped Q / Q by Q", "powersgd", "powersgd-qbyq", "unlimited", 1.0),
    ("resnet18", 2, "grouped Q / Q by Q", "powersgd", "powersgd-qbyq", "100mbit", 1.0),
    ("smallstep", 2, "grouped Q / Q by Q", "powersgd", "powersgd-qbyq", "unlimited", 1.0),
    ("smallstep", 2, "grouped Q / Q by Q", "powersgd", "powersgd-qbyq", "100mbit", 1.0),
    ("manyshapes", 2, "grouped Q / Q by Q", "powersgd", "powersgd-qbyq", "unlimited", 1.0),
    ("manyshapes", 2, "grouped Q / Q by Q", "powersgd", "powersgd-qbyq", "100mbit", 1.0),
)  # fmt: skip
# (model, rank, config, lower limit of plain fp32 bytes / bytes sent)
BYTE_TARGETS = (
    ("resnet18", 2, "powersgd", 130.0),
    ("resnet18", 2, "powersgd-fp16", 260.0),
    ("resnet18", 2, "powersgd-1round", 260.0),
    ("resnet18", 2, "powersgd-1round-fp16", 520.0),
)
# rank="auto" keeps the user's schedule: it is held to the fixed configurations of its own
# schedule (plain Horovod has none: it is in both), the best of the other shown beside.
PLAIN = ("horovod", "horovod-fp16")
SCHEDULES = {
    "powersgd-auto": (*PLAIN, "powersgd", "powersgd-fp16"),
    "powersgd-1round-auto": (*PLAIN, "powersgd-1round", "powersgd-1round-fp16"),
}
AUTO_UNLIMITED, AUTO_CAPPED, AUTO_LOCAL_50 = 1.02, 1.03, 1.05
SLOWED = "horovod-slowed"  # plain Horovod with a sleep injected: the proof that it measures


@dataclass(frozen=True)
class Comparison:
    """One ratio the report shows: numerator / denominator, judged against ``limit``."""

    name: str
    numerator: Record
    denominator: Record
    limit: float | None = None  # None: shown beside, not judged
    expected: float | None = None  # an injected slowdown: the ratio it must measure

    @property
    def paired(self) -> bool:
        return _paired(self.numerator, self.denominator)

    def interval(self) -> Interval | None:
        """The per-round ratio's median and interval; None for records of separate jobs."""
        if not self.paired:
            return None
        return confidence.ratio_interval(self.numerator.round_ms, self.denominator.round_ms)

    def value(self) -> float:
        interval = self.interval()
        if interval is not None:
            return interval.median
        return self.numerator.median_step_ms / self.denominator.median_step_ms

    def verdict(self) -> str:
        interval = self.interval()
        if self.expected is not None:
            if interval is None:
                return "not resolved"
            return confidence.slowdown_verdict(interval, self.expected)
        if self.limit is None:
            return ""
        if interval is None:  # separate jobs: no interval to decide with
            return ("hit" if self.value() <= self.limit else "missed") + " (no interval)"
        return confidence.verdict(interval, self.limit)


def label(record: Record) -> str:
    """``powersgd r2``, ``horovod``: the configuration as the tables name it."""
    return record.config + (f" r{record.rank}" if record.rank else "")


def _paired(a: Record, b: Record) -> bool:
    return bool(a.round_ms) and bool(b.round_ms) and len(a.round_ms) == len(b.round_ms)


def find(records: Iterable[Record], config: str, rank: int | None = None) -> Record | None:
    for r in records:
        if r.config == config and (rank is None or r.rank == rank):
            return r
    return None


def _fastest(records: Sequence[Record], configs: Sequence[str]) -> Record | None:
    pool = [r for r in records if r.config in configs]
    return min(pool, key=lambda r: r.median_step_ms) if pool else None


def auto_comparisons(at: Sequence[Record]) -> list[Comparison]:
    """rank="auto" against its targets, for the records of one model at one link."""
    out = []
    for auto_config, own in SCHEDULES.items():
        auto = find(at, auto_config)
        if auto is None:
            continue
        model, bw = auto.model, auto.bandwidth
        if bw == "unlimited":
            best = _fastest(at, PLAIN)
            if best is not None:
                text = f"{model}: {auto_config} / faster of plain and fp16 ({label(best)}), {bw}"
                out.append(Comparison(text, auto, best, AUTO_UNLIMITED))
            continue
        other = tuple(c for s in SCHEDULES.values() for c in s if c not in own)
        best, beside = _fastest(at, own), _fastest(at, other)
        if best is not None:
            text = f"{model}: {auto_config} / best fixed, same schedule ({label(best)}), {bw}"
            out.append(Comparison(text, auto, best, AUTO_CAPPED))
        if beside is not None:
            text = f"{model}: {auto_config} / best fixed, other schedule ({label(beside)}), {bw}"
            out.append(Comparison(text, auto, beside))
        local = find(at, "local")
        if bw == "50mbit" and local is not None:
            text = f"{model}: {auto_config} / local, {bw}"
            out.append(Comparison(text, auto, local, AUTO_LOCAL_50))
    return out


def time_comparisons(at: Sequence[Record]) -> list[Comparison]:
    """TIME_TARGETS and the injected slowdown, for the records of one model at one link."""
    out = []
    if not at:
        return out
    model, bw = at[0].model, at[0].bandwidth
    for t_model, rank, text, num_cfg, den_cfg, t_bw, limit in TIME_TARGETS:
        if (t_model, t_bw) != (model, bw):
            continue
        num = find(at, num_cfg, rank)
        den = find(at, den_cfg, rank if den_cfg in RANKED else None)
        if num and den:
            out.append(Comparison(f"{model}: {text}, r{rank}, {bw}", num, den, limit))
    slowed, plain = find(at, SLOWED), find(at, "horovod")
    if slowed and plain:
        fraction = (slowed.settings or {}).get("slowdown", 0.05)
        text = f"{model}: injected {fraction:.0%} slowdown (horovod-slowed / horovod), {bw}"
        out.append(Comparison(text, slowed, plain, expected=1 + fraction))
    return out


def comparisons(at: Sequence[Record]) -> list[Comparison]:
    """Every judged or shown comparison for the records of one model at one link."""
    return auto_comparisons(at) + time_comparisons(at)


def needed_intervals(at: Sequence[Record]) -> list[Interval]:
    """The intervals a paired job must make precise before it stops.

    Those of its targets (judged ones and the injected slowdown); with no target for
    this model and link, every configuration's ratio to plain Horovod (or to local).
    """
    needed = [c for c in comparisons(at) if c.limit is not None or c.expected is not None]
    if not needed:
        ref = find(at, "horovod") or find(at, "local")
        needed = [Comparison("", r, ref) for r in at if ref is not None and r is not ref]
    return [i for i in (c.interval() for c in needed) if i is not None]
