"""One paired benchmark job: every configuration of one model at one link, in one job.

Started by the driver (``python -m horovod_powersgd.bench --paired``) under ``mpirun``, one
process per rank. Each configuration gets its own copy of the model (the same initial
weights) and its own optimizer wrapper; after an untimed warm-up of each, the job runs
rounds: a short block of steps of every configuration, in an order that rotates from round
to round, the first step after a switch untimed. A step's time is the slowest rank's (a
Max all-reduce after the step, outside the timed region). Comparing each configuration's
block with the reference's block of the same round cancels what slowed the whole machine
in that round (confidence.py). The job stops when every interval its targets need is
within +-1 % (targets.py), or when its time budget would run out, and says which.

Writes ``<out-dir>/paired.json`` on rank 0: per configuration the block median of every
round, every timed step, the bytes it sent per step; the job's peak RSS and why it stopped.
Rank 0 touches ``<out-dir>/progress`` after every step, warm-up or timed: the driver ends a
job that has not for ``--timeout`` seconds (a stall), however long its warm-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from . import confidence, targets
from .configs import HOROVOD_CONFIGS
from .models import MODELS
from .stats import make_record
from .worker import (
    AUTO_WARMUP_STEPS,
    COUNTED,
    _peak_rss_mb,
    _setup_horovod,
    _static_counters,
)

PAIRED_CONFIGS = ("local", *HOROVOD_CONFIGS, targets.SLOWED)
# rank="auto" warms up until its tuner settles (every rank agrees), at most this long.
AUTO_MAX_WARMUP_STEPS = 120
STOP_CODES = (None, "precise", "budget", "max rounds")
PROGRESS = "progress"  # in --out-dir: touched after every step


@dataclass
class Contender:
    """One configuration of the job: its model copy, optimizer and what it measured."""

    config: str
    rank: int | None
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    counters: Callable[[], dict]
    slowdown: float = 0.0  # extra seconds per second of step (horovod-slowed)
    round_ms: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    sent: dict = field(default_factory=lambda: dict.fromkeys(COUNTED, 0.0))
    counted_steps: int = 0  # the steps `sent` counts: every step of every block
    # rank="auto": its warm-up steps' seconds (the slowest rank's), and how many of them
    # ran before its tuner first settled (its choice's cost: docs/auto.md).
    warm_s: list[float] = field(default_factory=list)
    settled_after: int | None = None
    # horovod-slowed: every pause's taken / asked, and how late its recent sleeps woke.
    pause_ratios: list[float] = field(default_factory=list)
    late_s: deque = field(default_factory=lambda: deque(maxlen=51))

    @property
    def label(self) -> str:
        return self.config + (f" r{self.rank}" if self.rank else "")


def build(config: str, rank: int | None, args) -> Contender:
    """A configuration with a fresh model copy: the same seed gives the same weights."""
    torch.manual_seed(0)
    model = MODELS[args.model][0]()
    if config == "local":  # no communication: every rank trains alone
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        return Contender(config, rank, model, opt, _static_counters(0, 0, 0))
    setup = argparse.Namespace(
        config="horovod" if config == targets.SLOWED else config,
        rank=rank or 1,
        start_iter=args.start_iter,
        min_compression_rate=args.min_compression_rate,
    )
    opt, counters, _, _ = _setup_horovod(setup, model)
    slowdown = args.slowdown if config == targets.SLOWED else 0.0
    return Contender(config, rank, model, opt, counters, slowdown)


def _pause(seconds: float) -> float:
    """Sleep ``seconds``, as a step waiting on a slow peer would; the seconds it took.

    On a busy machine a sleep ends late (the scheduler's wake-up latency); the caller
    asks for that much less.
    """
    start = time.perf_counter()
    if seconds > 0:
        time.sleep(seconds)
    return time.perf_counter() - start


class Job:
    """The rounds of one paired job (every rank runs the same calls in the same order)."""

    def __init__(self, args, contenders: list[Contender], hvd):
        self.args, self.contenders, self.hvd = args, contenders, hvd
        make_batch, self.loss_fn = MODELS[args.model][1], MODELS[args.model][2]
        generator = torch.Generator().manual_seed(1000 + hvd.rank())
        self.batch = make_batch(args.batch_size, generator)
        self.started = time.monotonic()
        self.timing_from = self.started  # the budget counts from the end of the warm-up
        # Rank 0 touches it after every step (`PROGRESS` in --out-dir).
        self.progress = args.out_dir / PROGRESS if hvd.rank() == 0 else None

    def _max(self, values: list[float], name: str) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64)
        return self.hvd.allreduce(tensor, op=self.hvd.Max, name=f"bench.paired.{name}").tolist()

    def step(self, c: Contender) -> float:
        """One training step of ``c``; the slowest rank's seconds."""
        start = time.perf_counter()
        c.opt.zero_grad()
        self.loss_fn(c.model, self.batch).backward()
        c.opt.step()
        if hasattr(c.counters, "step"):
            c.counters.step()
        late = self._pause(c, time.perf_counter() - start) if c.slowdown else 0.0
        seconds = time.perf_counter() - start
        # After the timed region, not timed itself: the slowest rank's step, the latest wake-up.
        seconds, latest = self._max([seconds, late], "step")
        if c.slowdown:
            c.late_s.append(latest)
        if self.progress is not None:  # the driver's stall guard reads its time
            self.progress.touch()
        return seconds

    def _pause(self, c: Contender, step_s: float) -> float:
        """horovod-slowed: every rank ends its step late by `slowdown` of it.

        A sleep on a busy machine wakes late, and the step (the slowest rank's) carries
        the latest of the ranks' wake-ups: each pause asks for the typical latest one
        less, so that the typical step (the block's median) is slowed as asked. Measured
        with both cores kept busy by two other processes: correcting by each rank's own
        lateness read up to 3 % above the slowdown; pausing one rank only read 1-3 %
        below (the other rank, late itself, hid part of the pause). Returns how late
        this sleep woke.
        """
        asked = c.slowdown * step_s
        typical_latest = confidence.median(c.late_s) if c.late_s else 0.0
        request = max(0.0, asked - typical_latest)
        taken = _pause(request)
        c.pause_ratios.append(taken / asked)
        return taken - request

    def warm_up(self, c: Contender) -> int:
        """Untimed steps; rank="auto" goes on until its tuner has settled on every rank."""
        steps = self.args.warmup_steps
        auto = c.config.endswith("auto")
        if auto:
            steps = max(steps, AUTO_WARMUP_STEPS)
        for _ in range(steps):
            self._warm_step(c, auto)
        while auto and steps < AUTO_MAX_WARMUP_STEPS:
            if self._max([float(c.opt.powersgd_state.tuner.phase != "settled")], "settled")[0] == 0:
                break
            self._warm_step(c, auto)
            steps += 1
        return steps

    def _warm_step(self, c: Contender, auto: bool) -> None:
        """A warm-up step; rank="auto": its time, and whether its tuner settled in it (one
        plan for all ranks: each rank's tuner settles at the same step)."""
        seconds = self.step(c)
        if auto:
            c.warm_s.append(seconds)
            if c.settled_after is None and c.opt.powersgd_state.tuner.phase == "settled":
                c.settled_after = len(c.warm_s)

    def block(self, c: Contender) -> None:
        """The first step after a switch untimed, then ``block_steps`` timed ones.

        The bytes are counted over the whole block, the untimed step too: rounds=1 sends
        Q and P on alternate steps, and 3 timed steps of a 4-step block count the same
        parity in every block (Q, P, Q or P, Q, P: the one-round rank 2 of ResNet-18 read
        203.8x fewer bytes than plain, and auto with the same plan 301.7x, by phase alone).
        """
        before = c.counters()
        self.step(c)
        times = [self.step(c) for _ in range(self.args.block_steps)]
        after = c.counters()
        for key in COUNTED:
            c.sent[key] += after[key] - before[key]
        c.counted_steps += 1 + self.args.block_steps
        c.step_ms += [1e3 * t for t in times]
        c.round_ms.append(1e3 * confidence.median(times))

    def decide(self, rounds: int, round_s: float) -> str | None:
        """Rank 0 decides whether to stop; every rank learns it."""
        code = 0.0
        if self.hvd.rank() == 0:
            intervals = None
            if confidence.check_due(rounds, self.args.min_rounds):
                intervals = targets.needed_intervals([self.record(c) for c in self.contenders])
            reason = confidence.stop_reason(
                intervals,
                rounds=rounds,
                min_rounds=self.args.min_rounds,
                tolerance=self.args.tolerance,
                elapsed_s=time.monotonic() - self.timing_from,
                budget_s=self.args.budget_s,
                round_s=round_s,
            )
            if reason is None and rounds >= self.args.max_rounds:
                reason = "max rounds"
            code = float(STOP_CODES.index(reason))
        return STOP_CODES[int(self._max([code], "stop")[0])]

    def run(self) -> dict:
        warmup = {c.label: self.warm_up(c) for c in self.contenders}
        self.timing_from = time.monotonic()
        rounds, reason = 0, None
        while reason is None:
            t0 = time.monotonic()
            shift = rounds % len(self.contenders)
            for c in self.contenders[shift:] + self.contenders[:shift]:
                self.block(c)
            rounds += 1
            reason = self.decide(rounds, time.monotonic() - t0)
        return {
            "stopped": reason,
            "rounds": rounds,
            "seconds": time.monotonic() - self.started,
            "warmup_s": self.timing_from - self.started,
            "warmup_steps": warmup,
            # The typical pause taken over asked (1.0: the slowdown asked, step by step).
            "pause_taken_over_asked": {
                c.label: confidence.median(c.pause_ratios)
                for c in self.contenders
                if c.pause_ratios
            },
            "step_ms": {c.label: c.step_ms for c in self.contenders},
        }

    def record(self, c: Contender, peak_rss_mb: float = 0.0):
        sent = {k: v / max(1, c.counted_steps) for k, v in c.sent.items()}
        record = make_record(
            config=c.config,
            model=self.args.model,
            rank=c.rank,
            np=self.hvd.size(),
            bandwidth=self.args.bandwidth,
            step_times_s=[[t / 1e3 for t in c.step_ms] or [0.0]],
            elements_per_step=sent["elements_sent"],
            bytes_per_step=sent["bytes_sent"],
            plain_bytes_per_step=4.0 * sent["elements_uncompressed"],
            peak_rss_mb=[peak_rss_mb],
            detail=_auto_detail(c) + _settle_detail(c),
            settings={"slowdown": self.args.slowdown},
        )
        return dataclasses.replace(record, round_ms=list(c.round_ms))


def _auto_detail(c: Contender) -> str:
    """rank="auto": the plan it settled on (bucket by bucket, p = plain) and the link."""
    if not c.config.endswith("auto"):
        return ""
    state = c.opt.powersgd_state
    tuner = state.tuner.state_dict()
    plan = [state.compressor.ranks.get(b.index) for b in state.reducer.buckets]
    if tuner["node"] is not None:  # hierarchical: this rank's compressor holds its share's
        plan = tuner["node"]["plan"]
    link = state.tuner.measurements.link
    text = describe_plan(plan, link.bytes_per_s, link.latency_s)
    layout = tuner["layout"]  # hierarchical="auto": the layout taken, the model's steps
    if layout is not None:
        text += ", {} (model: flat {:.0f} ms, hierarchical {:.0f} ms)".format(
            "hierarchical" if layout["hierarchical"] else "flat",
            1e3 * layout["flat_s"], 1e3 * layout["hierarchical_s"],
        )  # fmt: skip
    return text


def _settle_detail(c: Contender) -> str:
    """rank="auto": when its tuner settled, and what those steps took beside as many of its
    settled steps (the timed ones' median): what measuring and trying cost."""
    if c.settled_after is None:
        return ""
    n, settled_s = c.settled_after, confidence.median(c.step_ms) / 1e3 if c.step_ms else 0.0
    spent = sum(c.warm_s[:n])
    return f", settled after {n} steps, {spent:.1f} s ({n} settled steps: {n * settled_s:.1f} s)"


def describe_plan(plan, bytes_per_s: float, latency_s: float) -> str:
    """``plan [2 2 p], link 710 Mbit/s 43.55 ms``; a link without a cost per byte says so.

    Example:
        >>> describe_plan([0, 2], float("inf"), 0.02)
        'plan [p 2], link: no cost per byte measured, 20.00 ms'
    """
    text = "plan [" + " ".join("p" if r == 0 else str(r) for r in plan) + "], link"
    if bytes_per_s == float("inf"):
        return f"{text}: no cost per byte measured, {1e3 * latency_s:.2f} ms"
    return f"{text} {8e-6 * bytes_per_s:.0f} Mbit/s {1e3 * latency_s:.2f} ms"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", choices=sorted(MODELS), required=True)
    p.add_argument("--plan", required=True, help="JSON list of [config, rank or null]")
    p.add_argument("--bandwidth", default="unlimited", help="the link's name, for the targets")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--warmup-steps", type=int, default=15)
    p.add_argument("--block-steps", type=int, default=3, help="timed steps per block")
    p.add_argument("--min-rounds", type=int, default=confidence.MIN_ROUNDS)
    p.add_argument("--max-rounds", type=int, default=1000)
    p.add_argument("--budget-s", type=float, default=900.0)
    p.add_argument("--tolerance", type=float, default=confidence.TOLERANCE)
    p.add_argument("--slowdown", type=float, default=0.05, help="of horovod-slowed's step")
    p.add_argument("--start-iter", type=int, default=2)
    p.add_argument("--min-compression-rate", type=float, default=2.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out-dir", type=Path, required=True)
    args = p.parse_args(argv)

    import horovod.torch as hvd

    torch.set_num_threads(args.threads)
    plan = json.loads(args.plan)
    if any(config.startswith("powersgd-hier") for config, _ in plan):  # its sets come later
        os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
    hvd.init()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    contenders = [build(config, rank, args) for config, rank in plan]
    job = Job(args, contenders, hvd)
    outcome = job.run()
    peak = max(job._max([_peak_rss_mb()], "rss"))
    counts = job._max([v for c in contenders for v in c.sent.values()], "sent")
    for i, c in enumerate(contenders):  # every rank's largest count, as the old path
        c.sent = dict(zip(COUNTED, counts[i * len(COUNTED) : (i + 1) * len(COUNTED)]))
    if hvd.rank() == 0:
        records = [job.record(c, peak).as_dict() for c in contenders]
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "paired.json").write_text(json.dumps(dict(outcome, records=records)))


if __name__ == "__main__":
    main()
