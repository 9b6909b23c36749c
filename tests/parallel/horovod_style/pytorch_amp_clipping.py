"""Mixed precision and gradient clipping, written like Horovod's examples/pytorch.

Launch (from the repository root):

    horovodrun -np 2 -H localhost:2 python tests/parallel/horovod_style/pytorch_amp_clipping.py
    mpirun -np 2 python tests/parallel/horovod_style/pytorch_amp_clipping.py --init-scale 3e38

The pattern Horovod documents for AMP and clipping: synchronize() the all-reduce, unscale and
clip the averaged gradients, then step inside skip_synchronize(). On a CPU, autocast computes
in bfloat16 and torch.amp.GradScaler("cpu") scales the loss; a huge --init-scale makes the first
steps overflow, so that the scaler skips them and backs off. This is a plain Horovod script;
tests/parallel/test_horovod_scripts.py also runs it with its one `hvd.DistributedOptimizer` call
swapped for `horovod_powersgd.DistributedOptimizer` and nothing else changed.
"""

import argparse
import os
import sys

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "examples")
sys.path.insert(0, os.path.normpath(EXAMPLES))
from fashion_mnist import read_idx  # noqa: E402  (the repository example's IDX reader)

# Per-pixel mean and standard deviation of the Fashion-MNIST training images.
MEAN, STD = 0.2860, 0.3530


def build_parser():
    parser = argparse.ArgumentParser(
        description="PyTorch mixed precision + gradient clipping example",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--data-dir", default="/usr/share/datasets/fashion-mnist", help="folder of the IDX files"
    )
    parser.add_argument("--train-samples", type=int, default=3000, help="training images used")
    parser.add_argument("--batch-size", type=int, default=32, help="training batch per worker")
    parser.add_argument("--epochs", type=int, default=2, help="number of epochs to train")
    parser.add_argument("--lr", type=float, default=0.01, help="learning rate for one worker")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="clip gradients to this")
    parser.add_argument(
        "--init-scale", type=float, default=2.0**16, help="GradScaler's initial loss scale"
    )
    parser.add_argument(
        "--no-autocast", action="store_true", default=False, help="compute in float32"
    )
    parser.add_argument("--seed", type=int, default=42, help="random seed")
    parser.add_argument(
        "--fp16-allreduce", action="store_true", default=False, help="fp16 compression on the wire"
    )
    return parser


class MLP(nn.Module):
    """784 -> 256 -> 128 -> 10."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 256)
        self.fc2 = nn.Linear(256, 128)
        self.fc3 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc3(F.relu(self.fc2(x)))


def load_train(data_dir, samples):
    images = read_idx(os.path.join(data_dir, "train-images-idx3-ubyte.gz"))[:samples]
    labels = read_idx(os.path.join(data_dir, "train-labels-idx1-ubyte.gz"))[:samples]
    return TensorDataset((images.float() / 255 - MEAN) / STD, labels.long())


def metric_average(value, name):
    # Horovod: average a metric over all workers.
    return hvd.allreduce(torch.tensor(float(value)), name=name).item()


def log(text):
    # Horovod: print on the first worker only.
    if hvd.rank() == 0:
        print(text, flush=True)


def main(argv=None):
    args = build_parser().parse_args(argv)

    hvd.init()  # Horovod: initialize the library.
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # Horovod: limit the number of CPU threads per worker.

    train_dataset = load_train(args.data_dir, args.train_samples)
    # Horovod: DistributedSampler partitions the data among workers: num_replicas and rank.
    train_sampler = DistributedSampler(train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)

    model = MLP()
    # Horovod: scale the learning rate by the number of workers.
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)

    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Horovod: wrap the optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), compression=compression
    )

    # Horovod: broadcast parameters & optimizer state from the first worker.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    scaler = torch.amp.GradScaler("cpu", init_scale=args.init_scale)
    first_loss = None
    skipped_steps = 0
    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)  # Horovod: the same new shuffle on all workers.
        losses = []
        for data, target in train_loader:
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not args.no_autocast):
                loss = F.cross_entropy(model(data), target)
            scaler.scale(loss).backward()
            # Horovod: wait for the averaged gradients before unscaling and clipping them.
            optimizer.synchronize()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            # Horovod: the gradients are averaged already; step without synchronizing again.
            with optimizer.skip_synchronize():
                scaler.step(optimizer)
            scale = scaler.get_scale()
            scaler.update()
            # An overflow (seen by every worker, since gradients are averaged) skips the step.
            skipped_steps += scaler.get_scale() < scale
            losses.append(loss.item())
        if first_loss is None:
            first_loss = metric_average(losses[0], "first_loss")  # Horovod: over all workers.
        train_loss = metric_average(sum(losses) / len(losses), "train_loss")
        log(
            f"Train Epoch: {epoch}\tLoss: {train_loss:.4f}\tscale {scaler.get_scale():.3g}, "
            f"{skipped_steps} step(s) skipped so far"
        )

    return {
        "first_loss": first_loss,
        "train_loss": train_loss,
        "final_loss": metric_average(losses[-1], "final_loss"),
        "skipped_steps": skipped_steps,
        "final_scale": scaler.get_scale(),
        "checksum": sum(p.detach().double().sum().item() for p in model.parameters()),
        "model": model,
        "optimizer": optimizer,
    }


if __name__ == "__main__":
    main()
