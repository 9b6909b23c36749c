"""A cost model of one training step, fitted to measurements, to extrapolate beyond one machine.

Model (per worker, synchronous data parallelism, W workers, link rate B bit/s):

    T(W, B) = fixed_c · s + rounds_c · 2(W−1) · hop_latency + efficiency · 8·bytes_c · 2(W−1)/W / B

* ``fixed_c``: everything that does not scale with the link: forward/backward,
  PowerSGD's matmuls and orthogonalisation, framework overhead. Fitted per
  configuration; ``s`` rescales it to other hardware (1 = this machine).
* ``rounds_c · 2(W−1) · hop_latency``: a ring all-reduce of W workers takes
  2(W−1) sequential hops per collective round; PowerSGD has 2 rounds a step,
  plain Horovod one per fusion buffer.
* ``bytes_c · 2(W−1)/W``: the bytes a ring all-reduce puts on each worker's link.
  ``efficiency`` (>= 0, one for the whole machine) is how many nominal seconds a
  wire second really costs (TCP, tbf, no overlap with backward: 1.0 = the link
  runs at its nominal rate and nothing overlaps).

The fit is least squares with one intercept per configuration and one shared
slope, over measurements at several bandwidths (an unlimited run counts as
zero wire time). The ring's steps and bytes are collectives.py's (the one table
of collective costs); the step model that plans and scales is planner.py's with
collectives.py (bench/scale.py): this fit only summarises measured runs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..collectives import TABLE
from .netcap import parse_bandwidth


def ring_factor(workers: int) -> float:
    """Bytes on each link of a ring all-reduce, per byte reduced: 2(W−1)/W.

    Example:
        >>> ring_factor(1), ring_factor(2), ring_factor(4)
        (0.0, 1.0, 1.5)
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    return float(TABLE["ring"][1](workers))


def wire_seconds(bytes_per_step: float, workers: int, bits_per_second: float | None) -> float:
    """Nominal seconds a ring all-reduce of ``bytes_per_step`` keeps a link busy; 0 if unlimited."""
    if bits_per_second is None:
        return 0.0
    return 8.0 * bytes_per_step * ring_factor(workers) / bits_per_second


def emulated_wire_seconds(
    bytes_per_step: float, workers: int, bits_per_second: float | None
) -> float:
    """Wire seconds on the benchmark's emulated network: one capped loopback for all workers.

    Unlike a switched network, where every worker has a link of its own, the
    namespace's single ``tc`` queue carries the traffic of all W workers, so it
    is busy W times as long as one worker's link would be.
    """
    return workers * wire_seconds(bytes_per_step, workers, bits_per_second)


@dataclass(frozen=True)
class Fit:
    """Fitted parameters: seconds of fixed cost per configuration, one efficiency."""

    fixed_s: dict[str, float]
    efficiency: float
    residual_rms_s: float


def fit(samples: Iterable[tuple[str, float, float]]) -> Fit:
    """Fit per-configuration intercepts and one shared slope.

    Args:
        samples: (configuration, wire seconds, measured step seconds) triples.

    Returns:
        The fit; the slope is clipped at 0 (more bandwidth never slows a step).

    Example:
        >>> f = fit([("a", 0.0, 1.0), ("a", 1.0, 3.0), ("b", 0.0, 2.0), ("b", 0.5, 3.0)])
        >>> round(f.efficiency, 6), {k: round(v, 6) for k, v in f.fixed_s.items()}
        (2.0, {'a': 1.0, 'b': 2.0})
    """
    groups: dict[str, list[tuple[float, float]]] = {}
    for config, x, t in samples:
        groups.setdefault(config, []).append((x, t))
    if not groups:
        raise ValueError("no samples to fit")
    num = den = 0.0
    means = {}
    for config, pts in groups.items():
        mx = sum(x for x, _ in pts) / len(pts)
        mt = sum(t for _, t in pts) / len(pts)
        means[config] = (mx, mt)
        num += sum((x - mx) * (t - mt) for x, t in pts)
        den += sum((x - mx) ** 2 for x, _ in pts)
    slope = max(0.0, num / den) if den > 0 else 1.0
    fixed = {c: mt - slope * mx for c, (mx, mt) in means.items()}
    sq = [(t - fixed[c] - slope * x) ** 2 for c, pts in groups.items() for x, t in pts]
    return Fit(fixed_s=fixed, efficiency=slope, residual_rms_s=math.sqrt(sum(sq) / len(sq)))


def predict_step_s(
    model: Fit,
    config: str,
    *,
    bytes_per_step: float,
    rounds: int,
    workers: int,
    bits_per_second: float,
    hop_latency_s: float,
    compute_scale: float = 1.0,
) -> float:
    """Predicted seconds of one step of ``config`` on W workers at a link rate."""
    latency = rounds * TABLE["ring"][0](workers) * hop_latency_s
    wire = model.efficiency * wire_seconds(bytes_per_step, workers, bits_per_second)
    return model.fixed_s[config] * compute_scale + latency + wire


def horovod_rounds(bytes_per_step: float, fusion_threshold_bytes: float = 64 * 2**20) -> int:
    """Fused all-reduce rounds of plain Horovod: one per fusion buffer (64 MiB by default)."""
    return max(1, math.ceil(bytes_per_step / fusion_threshold_bytes))


def speedup_table(
    model: Fit,
    *,
    plain: tuple[str, float],
    compressed: tuple[str, float],
    workers: Sequence[int],
    bandwidths: Sequence[str],
    hop_latency_s: float,
    compute_scale: float = 1.0,
) -> dict[tuple[int, str], float]:
    """Predicted step-time ratio plain / compressed for each (workers, bandwidth).

    Args:
        plain, compressed: (configuration name, bytes per step per worker).
    """
    out = {}
    for w in workers:
        for bw in bandwidths:
            bits = parse_bandwidth(bw)
            t_plain = predict_step_s(
                model,
                plain[0],
                bytes_per_step=plain[1],
                rounds=horovod_rounds(plain[1]),
                workers=w,
                bits_per_second=bits,
                hop_latency_s=hop_latency_s,
                compute_scale=compute_scale,
            )
            t_comp = predict_step_s(
                model,
                compressed[0],
                bytes_per_step=compressed[1],
                rounds=2,
                workers=w,
                bits_per_second=bits,
                hop_latency_s=hop_latency_s,
                compute_scale=compute_scale,
            )
            out[(w, bw)] = t_plain / t_comp
    return out
