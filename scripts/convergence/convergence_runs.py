"""What one run of the convergence campaign is, and what its record measures."""

from __future__ import annotations

import math
import os
import platform
import statistics
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The launcher settings the README recommends: without yield-when-idle, a rank waiting in
# MPI spins on a core the other rank needs (2 workers on 2 cores).
MPI_ARGS = "--mca mpi_yield_when_idle 1"

EXAMPLES = {
    # name: (script, metric key, label, higher is better)
    "fashion_mnist": ("examples/fashion_mnist.py", "test_accuracy", "test accuracy", True),
    "lstm_language_model": (
        "examples/lstm_language_model.py",
        "test_perplexity",
        "test perplexity",
        False,
    ),
    "transformer_lm": ("examples/transformer_lm.py", "test_perplexity", "test perplexity", False),
}
# examples/transformer_lm.py's --warmup-steps default: the LR warm-up, and start_iter with it.
TRANSFORMER_WARMUP = 200
LANGUAGE_MODELS = ("lstm_language_model", "transformer_lm")


def machine() -> str:
    """This machine's processor and cores, as each run's record keeps them.

    Sessions here get machines of one kind but not always the same CPU: a run repeated on
    another CPU does not repeat bitwise (other BLAS kernels, other summation order), and
    epoch times compare only between runs of one CPU.
    """
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor is enough: all are alike here
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return f"{name}, {os.cpu_count()} cores"


@dataclass(frozen=True)
class Config:
    """One configuration; its runs differ only by seed."""

    example: str
    rank: int | str  # 0 = plain Horovod; "auto" = chosen per bucket
    rounds: int = 2
    start_iter: int = 0
    link: str = ""  # rank="auto": the link it plans for (--powersgd-link)

    @property
    def key(self) -> str:
        if self.rank == 0:
            return f"{self.example}-plain"
        if self.rank == "auto":
            return f"{self.example}-auto-{self.link}-rounds{self.rounds}-si{self.start_iter}"
        return f"{self.example}-r{self.rank}-rounds{self.rounds}-si{self.start_iter}"

    @property
    def label(self) -> str:
        if self.rank == 0:
            return "plain Horovod"
        if self.rank == "auto":
            return f"auto ({self.link} link's plan), rounds={self.rounds}"
        text = f"rank {self.rank}, rounds={self.rounds}"
        return text + (f", start_iter {self.start_iter}" if self.start_iter else "")

    @property
    def order(self) -> float:
        """Where the report lists it: plain, then by rank, auto last."""
        return math.inf if self.rank == "auto" else self.rank


def config_of(records):
    """The configuration of `records`, runs of one configuration."""
    c = records[0]["config"]
    return Config(c["example"], c["rank"], c["rounds"], c["start_iter"], c.get("link", ""))


def metric_scale(example):
    """Record units to report units: accuracy in %, perplexity as it is."""
    return 100.0 if example == "fashion_mnist" else 1.0


def metric(record, epoch=None):
    """The example's metric after `epoch` (default: the last), in report units."""
    key = EXAMPLES[record["example"]][1]
    e = record["epochs"][-1 if epoch is None else epoch - 1]
    return metric_scale(record["example"]) * e[key]


def ratio_through(record, epoch):
    """Uncompressed bytes / bytes sent, over epochs 1..epoch."""
    sent = sum(e["bytes_sent"] for e in record["epochs"][:epoch])
    full = sum(e["bytes_sent"] * e["ratio"] for e in record["epochs"][:epoch])
    return full / sent


def epoch_seconds(records):
    """The median training time of one epoch, over every epoch of `records`."""
    return statistics.median(e["train_time_s"] for r in records for e in r["epochs"])


def all_finite(records):
    """Whether no run of `records` ended with a NaN or infinite metric."""
    return all(math.isfinite(metric(r)) for r in records)


def late_mean(records, last=3, through=None):
    """Mean over seeds and over the last `last` epochs (up to `through`, default each run's
    last): less sensitive to one noisy epoch."""
    values = [
        metric(r, e) for r in records for e in range(1, (through or len(r["epochs"])) + 1)[-last:]
    ]
    return statistics.fmean(values)


def common_epoch(*groups):
    """The last epoch every run of `groups` has: runs trained for different epochs compare
    there, at the same point of the LR schedule."""
    return min(len(r["epochs"]) for records in groups for r in records)


def pair_by_seed(plain, records):
    """(plain runs, runs of `records`) of the seeds both have; all of both if none match."""
    seeds = {r["args"]["seed"] for r in records} & {r["args"]["seed"] for r in plain}
    if not seeds:
        return plain, records
    return [r for r in plain if r["args"]["seed"] in seeds], [
        r for r in records if r["args"]["seed"] in seeds
    ]


FLAT = 1.0  # % an epoch may still improve validation perplexity, on average, and count as flat
FLAT_EPOCHS = 3  # epochs averaged: one quiet epoch between two LR cuts is not a plateau


def last_change(record):
    """% change of validation perplexity over the last epoch (NaN after one epoch)."""
    valid = [e["valid_perplexity"] for e in record["epochs"]]
    return 100 * (valid[-1] / valid[-2] - 1) if len(valid) > 1 else float("nan")


def recent_change(record, last=FLAT_EPOCHS):
    """Mean % change of validation perplexity per epoch over the last `last` epochs.

    Geometric mean of the per-epoch ratios; NaN before `last` + 1 epochs.
    """
    valid = [e["valid_perplexity"] for e in record["epochs"]]
    if len(valid) <= last:
        return float("nan")
    return 100 * ((valid[-1] / valid[-1 - last]) ** (1 / last) - 1)


def flattened(record):
    """Whether validation perplexity has flattened: `recent_change` above -FLAT %."""
    change = recent_change(record)
    return math.isfinite(change) and change > -FLAT


def lr_cuts(record):
    """Epochs after which the LR went down (each epoch's record holds the next epoch's LR)."""
    lrs = [record["args"]["lr"] * record["world_size"]] + [e["lr"] for e in record["epochs"]]
    return [
        e["epoch"] for e, before, after in zip(record["epochs"], lrs, lrs[1:]) if after < before
    ]
