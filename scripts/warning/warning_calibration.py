"""Record what PowerSGD's early warning sees, run by run, for calibrating its rule.

One training run per call. At every check of the statistics (every
`monitor.CHECK_EVERY` steps) it records the whole model's error norm and
gradient norm as `compression_stats(per_layer=True)` returns them (moving
averages, mean of the ranks: exactly what the rule in horovod_powersgd/monitor.py
is given), the mean training loss since the last check, where the loss first
became non-finite, and where the library's rule of the day warned. Rank 0
writes it all as one small JSON file; scripts/warning/warning_rules.py replays any rule
on those files offline.

Settings (each trains Fashion-MNIST from Debian's dataset-fashion-mnist):

    cnn             the examples' CNN in the loop of docs/results/rounds.md (first 20k
                    images, batch 64 per worker, SGD momentum 0.9, weight decay 5e-4)
    mlp             a 3-layer MLP (784-256-128-10), batch 64 per worker, SGD momentum 0.9
    elastic-mnist   Horovod's elastic MNIST setting, written here: hvd.elastic.run,
                    TorchState committed every batch, a 10/20-channel CNN with dropout,
                    batch 64, lr 0.01 x workers, momentum 0.5 (launch with horovodrun)
    horovod-mnist   tests/parallel/horovod_style/pytorch_mnist.py with its one
                    hvd.DistributedOptimizer call swapped; arguments after `--` go to it
    example-fashion examples/fashion_mnist.py; arguments after `--` go to it
    example-lstm    examples/lstm_language_model.py; arguments after `--` go to it
    example-transformer  examples/transformer_lm.py; arguments after `--` go to it

    mpirun -np 2 python scripts/warning/warning_calibration.py --out run.json cnn --rounds 1 \
        --lr 0.1 --start-iter 100 --seed 42
    mpirun -np 2 python scripts/warning/warning_calibration.py --out run.json horovod-mnist \
        -- --seed 43
    horovodrun -np 2 --min-np 2 --max-np 2 --host-discovery-script discover.sh \
        python scripts/warning/warning_calibration.py --out run.json elastic-mnist
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import types
import warnings

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn

import horovod_powersgd as hps
from horovod_powersgd import monitor

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "examples"))
import common  # noqa: E402  (the examples' shared helpers)
from fashion_mnist import DEFAULT_DATA_DIR, Net, load_split  # noqa: E402

HOROVOD_STYLE_MNIST = os.path.join(ROOT, "tests", "parallel", "horovod_style", "pytorch_mnist.py")


# The own loops' defaults: cnn is the setting of docs/results/rounds.md, mlp the
# 3-layer MLP of issue 36, elastic-mnist Horovod's elastic MNIST example's (lr per worker).
DEFAULTS = {
    "cnn": dict(lr=0.1, momentum=0.9, weight_decay=5e-4, train_subset=20000),
    "mlp": dict(lr=0.05, momentum=0.9, weight_decay=0.0, train_subset=60000),
    "elastic-mnist": dict(lr=0.01, momentum=0.5, weight_decay=0.0, train_subset=60000),
}


class Trace:
    """What one run's early warning saw, recorded from the optimizer it watches."""

    def __init__(self):
        self.optimizer = None
        self.checks: list[list[float]] = []  # [step, error norm, gradient norm]
        self.losses: list[float] = []  # this rank's loss, one per step
        self.library_warning_step: int | None = None
        self.settings: dict = {}

    def watch(self, optimizer) -> None:
        """Record after every synchronize() (step() calls it through the instance)."""
        self.optimizer = optimizer
        self.settings.update(
            rank=optimizer.config.rank,
            rounds=optimizer.config.rounds,
            start_iter=optimizer.config.start_iter,
        )
        original = optimizer.synchronize

        def synchronize():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                original()
            for w in caught:
                if issubclass(w.category, hps.ErrorGrowthWarning):
                    self.library_warning_step = self.library_warning_step or optimizer.powersgd_step
                else:
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            self._note_check(optimizer.powersgd_step)

        optimizer.synchronize = synchronize

    def _note_check(self, step: int) -> None:
        if step % monitor.CHECK_EVERY or (self.checks and self.checks[-1][0] == step):
            return
        stats = self.optimizer.compression_stats(per_layer=True)
        if stats["checked_step"] == step:
            self.checks.append([step, stats["error_norm"], stats["gradient_norm"]])

    def record(self, name: str, path: str) -> None:
        """Rank 0 writes the run; the non-finite step is the first on any rank."""
        bad = [i + 1 for i, loss in enumerate(self.losses) if not math.isfinite(loss)]
        first = torch.tensor([float(bad[0]) if bad else math.inf])
        first = hvd.allreduce(first, op=hvd.Min, name="trace.nonfinite").item()
        steps = self.optimizer.powersgd_step
        if hvd.rank() != 0:
            return
        rows = []
        for step, error, grad in self.checks:
            window = self.losses[max(0, step - monitor.CHECK_EVERY) : step]
            loss = sum(window) / len(window) if window else math.nan
            rows.append([step, _round(error), _round(grad), _round(loss)])
        run = {
            "run": name,
            "command": " ".join(["python", *sys.argv]),
            "workers": hvd.size(),
            **self.settings,
            "steps": steps,
            "nonfinite_step": None if math.isinf(first) else int(first),
            "library_warning_step": self.library_warning_step,
            "library_rule": {
                "WINDOW": monitor.WINDOW,
                "ERROR_GROWTH": monitor.ERROR_GROWTH,
                "GRADIENT_GROWTH": monitor.GRADIENT_GROWTH,
                "SETTLE_STEPS": monitor.SETTLE_STEPS,
            },
            "checks_columns": ["step", "error_norm", "gradient_norm", "mean_loss_since_last"],
            "checks": rows,
        }
        with open(path, "w") as f:
            json.dump(run, f, indent=None, separators=(",", ":"))
            f.write("\n")
        print(
            f"{name}: {steps} steps, non-finite at {run['nonfinite_step']}, library warned at "
            f"{self.library_warning_step}, {len(rows)} checks -> {path}",
            flush=True,
        )


def _round(value):
    if value is None or not math.isfinite(value):
        return None
    return float(f"{value:.5g}")


def watched(trace: Trace):
    """A stand-in for hps.DistributedOptimizer that hands the optimizer to the trace."""
    real = hps.DistributedOptimizer

    def factory(*args, **kwargs):
        optimizer = real(*args, **kwargs)
        trace.watch(optimizer)
        return optimizer

    return factory


# --- own training loops --------------------------------------------------------------------
def powersgd(trace: Trace, opt, model: nn.Module, args):
    """PowerSGD around `opt` with the own loops' settings, watched by `trace`."""
    return watched(trace)(
        opt,
        named_parameters=model.named_parameters(),
        rank=args.rank,
        rounds=args.rounds,
        start_iter=args.start_iter,
    )


def own_loop(args, trace: Trace, model: nn.Module, images, labels) -> None:
    """Random batches of 64 per worker (rank-seeded), stopping at the first non-finite loss."""
    opt = torch.optim.SGD(
        model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay
    )
    opt = powersgd(trace, opt, model, args)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    # The seeds of scripts/warning/error_growth.py's runs in docs/results/rounds.md (+ 100 x seed).
    generator = torch.Generator().manual_seed(hvd.rank() + 100 * args.seed)
    for _ in range(args.steps):
        idx = torch.randint(0, len(images), (args.batch_size,), generator=generator)
        opt.zero_grad()
        loss = F.cross_entropy(model(images[idx]), labels[idx])
        loss.backward()
        opt.step()
        trace.losses.append(loss.item())
        # Once one rank's loss is non-finite, the next aggregate is on every rank: all stop.
        finite = torch.tensor([float(math.isfinite(trace.losses[-1]))])
        if hvd.allreduce(finite, op=hvd.Min, name="trace.finite").item() == 0:
            break


class MLP(nn.Module):
    """784 -> 256 -> 128 -> 10 with ReLU."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Flatten(),
            nn.Linear(784, 256),
            nn.ReLU(),
            nn.Linear(256, 128),
            nn.ReLU(),
            nn.Linear(128, 10),
        )

    def forward(self, x):
        return self.layers(x)


def run_cnn(args, trace: Trace) -> None:
    torch.manual_seed(args.seed)
    images, labels = load_split(DEFAULT_DATA_DIR, "train", args.train_subset).tensors
    own_loop(args, trace, Net(), images, labels)


def run_mlp(args, trace: Trace) -> None:
    torch.manual_seed(args.seed)
    images, labels = load_split(DEFAULT_DATA_DIR, "train", args.train_subset).tensors
    own_loop(args, trace, MLP(), images, labels)


class DropoutCNN(nn.Module):
    """The size of Horovod's MNIST examples' model: 10 and 20 5x5 filters, 320 -> 50 -> 10."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, 5)
        self.conv2 = nn.Conv2d(10, 20, 5)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(F.dropout2d(self.conv2(x), 0.5, self.training), 2))
        x = F.dropout(F.relu(self.fc1(x.flatten(1))), 0.5, self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def run_elastic_mnist(args, trace: Trace) -> None:
    """Horovod's elastic pattern: the loop resumes from the committed state on a reset."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    torch.manual_seed(args.seed)
    dataset = load_split(DEFAULT_DATA_DIR, "train", args.train_subset)
    sampler = DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank())
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    model = DropoutCNN()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)
    opt = powersgd(trace, opt, model, args)
    state = hvd.elastic.TorchState(model, opt, epoch=1, batch=0)

    @hvd.elastic.run
    def train(state):
        for epoch in range(state.epoch, args.epochs + 1):
            state.epoch = epoch  # committed with the state: a reset resumes this epoch
            model.train()
            sampler.set_epoch(epoch)
            for batch, (x, y) in enumerate(loader):
                if batch < state.batch:
                    continue  # trained before the reset this state was restored from
                opt.zero_grad()
                loss = F.nll_loss(model(x), y)
                loss.backward()
                opt.step()
                trace.losses.append(loss.item())
                state.batch = batch + 1
                state.commit()  # a copy of model and optimizer state, PowerSGD's included
            state.batch = 0

    train(state)


# --- scripts run as they are ----------------------------------------------------------------
def run_horovod_mnist(argv: list[str], trace: Trace) -> None:
    """The Horovod-style script with exactly its one call changed, as a fresh module."""
    with open(HOROVOD_STYLE_MNIST) as f:
        source = f.read()
    plain, swapped = (
        "hvd.DistributedOptimizer(",
        '__import__("horovod_powersgd").DistributedOptimizer(',
    )
    assert source.count(plain) == 1
    module = types.ModuleType("horovod_style_pytorch_mnist")
    module.__file__ = HOROVOD_STYLE_MNIST
    exec(compile(source.replace(plain, swapped), HOROVOD_STYLE_MNIST, "exec"), module.__dict__)
    train = module.train

    def recorded_train(*a, **k):
        losses = train(*a, **k)
        trace.losses.extend(losses)
        return losses

    module.train = recorded_train
    hps.DistributedOptimizer = watched(trace)
    module.main(argv)


def run_example(main, argv: list[str], trace: Trace) -> None:
    """An example's main(); its TensorBoardLog.train_step sees every step's loss."""
    train_step = common.TensorBoardLog.train_step

    def recorded_step(self, loss):
        trace.losses.append(loss)
        return train_step(self, loss)

    common.TensorBoardLog.train_step = recorded_step
    hps.DistributedOptimizer = watched(trace)
    main(["--no-progress", *argv])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file rank 0 writes")
    parser.add_argument("--name", default=None, help="the run's name in the JSON")
    parser.add_argument(
        "setting",
        choices=(
            "cnn",
            "mlp",
            "elastic-mnist",
            "horovod-mnist",
            "example-fashion",
            "example-lstm",
            "example-transformer",
        ),
    )
    # The own loops' settings (the scripts' own flags go after `--`).
    parser.add_argument("--rounds", type=int, choices=(1, 2), default=2)
    parser.add_argument("--rank", type=int, default=2, help="PowerSGD rank")
    parser.add_argument("--lr", type=float, default=None, help="SGD learning rate (see DEFAULTS)")
    parser.add_argument("--momentum", type=float, default=None, help="SGD momentum (DEFAULTS)")
    parser.add_argument("--weight-decay", type=float, default=None, help="(see DEFAULTS)")
    parser.add_argument("--batch-size", type=int, default=64, help="per worker")
    parser.add_argument("--steps", type=int, default=300, help="cnn/mlp: steps")
    parser.add_argument("--epochs", type=int, default=1, help="elastic-mnist: epochs")
    parser.add_argument("--start-iter", type=int, default=0, help="plain steps first")
    parser.add_argument("--seed", type=int, default=42, help="model and data order")
    parser.add_argument("--train-subset", type=int, default=None, help="first N images (DEFAULTS)")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args, rest = parser.parse_args(argv[:split]), argv[split + 1 :]
    for flag, value in DEFAULTS.get(args.setting, {}).items():
        if getattr(args, flag) is None:
            setattr(args, flag, value)

    hvd.init()
    torch.set_num_threads(1)
    trace = Trace()
    if args.setting == "cnn":
        run_cnn(args, trace)
    elif args.setting == "mlp":
        run_mlp(args, trace)
    elif args.setting == "elastic-mnist":
        run_elastic_mnist(args, trace)
    elif args.setting == "horovod-mnist":
        run_horovod_mnist(rest, trace)
    elif args.setting == "example-fashion":
        import fashion_mnist

        run_example(fashion_mnist.main, rest, trace)
    elif args.setting == "example-lstm":
        import lstm_language_model

        run_example(lstm_language_model.main, rest, trace)
    else:
        import transformer_lm

        run_example(transformer_lm.main, rest, trace)
    trace.record(args.name or os.path.splitext(os.path.basename(args.out))[0], args.out)


if __name__ == "__main__":
    main()
