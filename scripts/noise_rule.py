"""How often rank="auto"'s pick of a timed plan follows the noise of its trials.

Seeded stand-in jobs (tests/unit/test_planner.py uses the same): the measure phase's
clean plain steps and each candidate's timed trial steps, every step its plan's true time
off by a normal error (the step's jitter), in one variant with a neighbour's burst now and
then. Two sets of candidates, as the tuner lists them:

- fast link: the model's choice (two buckets at rank 1), plain, rank 1 and rank 2
  everywhere; the choice and rank 1 faster than plain by `gain`, rank 2 5 % slower.
  Printed: the share of jobs that compress.
- slow link (plain hopeless, not tried): rank 1 and rank 2 everywhere, rank 2 slower by
  `gain` (a negative gain: faster). Printed: the share of jobs that take rank 2.

Each beside the rule before the trials' noise (the most accurate plan within 3 % of the
fastest median). The table is in docs/auto.md ("Noise").

    python scripts/noise_rule.py               # 20,000 jobs a cell, 2-3 minutes
    python scripts/noise_rule.py --jobs 2000
"""

from __future__ import annotations

import argparse
import random
import statistics

from horovod_powersgd import planner

TOLERANCE = 0.03  # tuner.TOLERANCE
CLEAN = 3  # the measure phase's clean plain steps (tuner.CLEAN)
TIMED = 4  # a candidate's timed steps (tuner.TRIAL_STEPS - 1)
PLANS = [[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [2, 2, 2, 2]]  # fast link, the tuner's order
PLAIN = PLANS[1]
RANKS = [[1, 1, 1, 1], [2, 2, 2, 2]]  # slow link


def timed_job(seed, plain_s, truths, jitter, outliers=False):
    """(the clean plain steps, each plan's timed steps) of one seeded job: every step its
    plan's true time (`truths`; plain's is `plain_s`) times 1 + a normal error of sd
    `jitter`, and with `outliers` one step in 20 also 30-100 % slower."""
    rng = random.Random(seed)

    def step(true_s):
        error = rng.gauss(0.0, jitter)
        if outliers and rng.random() < 0.05:
            error += rng.uniform(0.3, 1.0)
        return true_s * (1 + error)

    clean = [step(plain_s) for _ in range(CLEAN)]
    return clean, [[step(t) for _ in range(TIMED)] for t in truths]


def pick(plans, clean, steps):
    """The tuner's pick: the preferred plan within the trials' noise of the fastest."""
    return planner.pick_measured(plans, steps, TOLERANCE, [clean])[0]


def pick_before(plans, clean, steps):
    """The rule before the trials' noise: the most accurate (plain, then the highest
    ranks) of the plans whose median step is within 3 % of the fastest median."""
    medians = [statistics.median(g) for g in steps]
    near = [p for p, s in zip(plans, medians) if s <= min(medians) * (1 + TOLERANCE)]
    accuracy = [(min(r or 1e9 for r in p), sum(r or 1e6 for r in p)) for p in near]
    return near[accuracy.index(max(accuracy))]


def share(rule, plans, truths, avoid, jitter, outliers, jobs):
    """The share of `jobs` seeded jobs in which `rule` picks the plan `avoid`."""
    hits = 0
    for seed in range(jobs):
        clean, steps = timed_job(seed, 1.0, truths, jitter, outliers)
        hits += rule(plans, clean, steps) == avoid
    return hits / jobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20_000, help="seeded jobs a cell")
    args = parser.parse_args()
    print("| link | jitter | bursts | gain | this rule | before |")
    print("| --- | --- | --- | --- | --- | --- |")
    for link, gains in (("fast", (0.0, 0.01, 0.1, 0.2, 0.3)), ("slow", (0.0, 0.012, -0.2))):
        for outliers in (False, True):
            for jitter in (0.03, 0.05, 0.10):
                for gain in gains:
                    cells = []
                    for rule in (pick, pick_before):
                        if link == "fast":  # compressed: any plan but plain
                            truths = [1 - gain, 1.0, 1 - gain, 1.05]
                            plain = share(rule, PLANS, truths, PLAIN, jitter, outliers, args.jobs)
                            cells.append(1 - plain)
                        else:  # rank 2 taken
                            truths = [1.0, 1.0 + gain]
                            cells.append(
                                share(rule, RANKS, truths, RANKS[1], jitter, outliers, args.jobs)
                            )
                    shares = " | ".join(f"{100 * c:.2f} %" for c in cells)
                    bursts = "yes" if outliers else "no"
                    print(f"| {link} | {jitter:.0%} | {bursts} | {gain:+.1%} | {shares} |")


if __name__ == "__main__":
    main()
