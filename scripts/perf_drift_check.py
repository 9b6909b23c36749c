"""Cost of the drift check (issue 23): one check against 100 training steps, one process.

Times `DriftGuard.check` (a bit-pattern fingerprint of every parameter and its SGD
momentum; the all-gather is replaced by the local tensor, which costs one
small collective in a real run) and one forward/backward/SGD step of a
benchmark model, on one core, and prints the check's share of the steps
between two checks (`drift_check_every`, default 100).

    python scripts/perf_drift_check.py --model resnet18
    python scripts/perf_drift_check.py --model lstm --every 100
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from horovod_powersgd.bench.models import MODELS
from horovod_powersgd.guard import DriftGuard


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="resnet18")
    parser.add_argument("--every", type=int, default=100, help="steps between checks (100)")
    parser.add_argument("--repeat", type=int, default=5, help="timed checks and steps (5)")
    parser.add_argument("--batch-size", type=int, default=32, help="per step (32)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    make_model, make_batch, loss_fn = MODELS[args.model]
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batch = make_batch(args.batch_size, torch.Generator().manual_seed(0))
    guard = DriftGuard(
        list(model.named_parameters()),
        args.every,
        allgather=lambda tensor, name: tensor,
        broadcast=lambda tensors, name: None,
    )
    steps, checks = [], []
    for _ in range(args.repeat + 1):
        start = time.perf_counter()
        opt.zero_grad()
        loss_fn(model, batch).backward()
        opt.step()
        steps.append(time.perf_counter() - start)
        start = time.perf_counter()
        guard.check(opt.state)
        checks.append(time.perf_counter() - start)
    step, check = statistics.median(steps[1:]), statistics.median(checks[1:])
    print(
        f"{args.model}: step {step * 1e3:.1f} ms, check {check * 1e3:.2f} ms (median of "
        f"{args.repeat}); one check per {args.every} steps adds "
        f"{100 * check / (args.every * step):.4f} % to the step time"
    )


if __name__ == "__main__":
    main()
