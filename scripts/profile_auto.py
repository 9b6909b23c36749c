"""Does a settled rank="auto" step do more than a fixed rank with the same plan?

    OMP_NUM_THREADS=1 .venv/bin/python scripts/profile_auto.py

One process, the benchmark's small GPT: auto (its plan forced to rank 2 in every
bucket once settled) and a fixed rank=2 each run 10 steps under cProfile. Lists
every function called a different number of times, or whose own time differs
by more than 20 ms (docs/auto.md quotes the result).
"""

import cProfile
import pstats

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import horovod_powersgd as hps
from horovod_powersgd.bench.models import GPT, _gpt_batch

STEPS = 10


def profile(auto: bool) -> dict[str, tuple[int, float]]:
    """function -> (calls, own seconds) over STEPS settled steps."""
    torch.manual_seed(0)
    model = GPT()
    settings = {"rank": "auto", "auto_link": "50mbit"} if auto else {"rank": 2}
    opt = hps.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(),
        **settings,
    )
    generator = torch.Generator().manual_seed(0)

    def step():
        x, y = _gpt_batch(4, generator)
        opt.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()

    for _ in range(10):  # auto: measured and settled (pinned link: after 8)
        step()
    if auto:
        opt._tuner._apply(opt, [2] * len(opt._reducer.buckets))
    for _ in range(3):
        step()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(STEPS):
        step()
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    return {f"{k[0].split('/')[-1]}:{k[2]}": (v[1], v[2]) for k, v in stats.items()}


def main():
    hvd.init()
    auto, fixed = profile(True), profile(False)
    print(f"functions called a different number of times in {STEPS} steps, or >20 ms apart:")
    for name in sorted(auto.keys() | fixed.keys()):
        (ca, ta), (cf, tf) = auto.get(name, (0, 0.0)), fixed.get(name, (0, 0.0))
        if ca != cf or abs(ta - tf) > 0.02:
            print(f"  {name:60s} calls {ca:5d} auto, {cf:5d} fixed; own {ta:.3f} s, {tf:.3f} s")


if __name__ == "__main__":
    main()
