"""Fashion-MNIST training, written like Horovod's examples/pytorch MNIST example.

Launch (from the repository root):

    python tests/parallel/horovod_style/pytorch_mnist.py
    horovodrun -np 2 -H localhost:2 python tests/parallel/horovod_style/pytorch_mnist.py
    mpirun -np 2 python tests/parallel/horovod_style/pytorch_mnist.py --fp16-allreduce

A few thousand images of Debian's dataset-fashion-mnist (nothing is downloaded) train a small
CNN for two epochs in seconds. This is a plain Horovod script; tests/parallel/
test_horovod_scripts.py also runs it with its one `hvd.DistributedOptimizer` call swapped for
`horovod_powersgd.DistributedOptimizer` and nothing else changed.
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
        description="PyTorch Fashion-MNIST example",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--data-dir", default="/usr/share/datasets/fashion-mnist", help="folder of the IDX files"
    )
    parser.add_argument("--train-samples", type=int, default=3000, help="training images used")
    parser.add_argument("--test-samples", type=int, default=1000, help="test images used")
    parser.add_argument("--batch-size", type=int, default=32, help="training batch per worker")
    parser.add_argument("--test-batch-size", type=int, default=500, help="test batch per worker")
    parser.add_argument("--epochs", type=int, default=2, help="number of epochs to train")
    parser.add_argument("--lr", type=float, default=0.01, help="learning rate for one worker")
    parser.add_argument("--momentum", type=float, default=0.5, help="SGD momentum")
    parser.add_argument("--seed", type=int, default=42, help="random seed")
    parser.add_argument("--log-interval", type=int, default=20, help="batches between log lines")
    parser.add_argument(
        "--fp16-allreduce", action="store_true", default=False, help="fp16 compression on the wire"
    )
    parser.add_argument(
        "--gradient-predivide-factor",
        type=float,
        default=1.0,
        help="divide gradients by this before the sum, the rest after it",
    )
    return parser


class Net(nn.Module):
    """Two 5x5 convolutions (16, 32 channels), then 512 -> 64 -> 10."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=5)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=5)
        self.fc1 = nn.Linear(512, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)  # 28 -> 24 -> 12
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # 12 -> 8 -> 4
        x = F.relu(self.fc1(x.flatten(1)))
        return F.log_softmax(self.fc2(x), dim=1)


def load_split(data_dir, split, samples):
    images = read_idx(os.path.join(data_dir, f"{split}-images-idx3-ubyte.gz"))[:samples]
    labels = read_idx(os.path.join(data_dir, f"{split}-labels-idx1-ubyte.gz"))[:samples]
    return TensorDataset((images.unsqueeze(1).float() / 255 - MEAN) / STD, labels.long())


def metric_average(value, name):
    # Horovod: average a metric over all workers.
    return hvd.allreduce(torch.tensor(float(value)), name=name).item()


def log(text):
    # Horovod: print on the first worker only.
    if hvd.rank() == 0:
        print(text, flush=True)


def train(epoch, model, optimizer, train_loader, train_sampler, args):
    model.train()
    train_sampler.set_epoch(epoch)  # Horovod: a new shuffle every epoch, the same on all workers.
    losses = []
    for batch_idx, (data, target) in enumerate(train_loader):
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if batch_idx % args.log_interval == 0:
            # Horovod: len(train_sampler) is this worker's share of the data.
            log(
                f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_sampler)}]"
                f"\tLoss: {loss.item():.6f}"
            )
    return losses


def test(model, test_loader, test_sampler):
    model.eval()
    test_loss = correct = 0.0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            correct += (output.argmax(dim=1) == target).sum().item()
    # Horovod: average over this worker's share, then over all workers.
    test_loss = metric_average(test_loss / len(test_sampler), "avg_loss")
    test_accuracy = metric_average(correct / len(test_sampler), "avg_accuracy")
    log(f"Test set: Average loss: {test_loss:.4f}, Accuracy: {100 * test_accuracy:.2f}%")
    return test_loss, test_accuracy


def main(argv=None):
    args = build_parser().parse_args(argv)

    hvd.init()  # Horovod: initialize the library.
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # Horovod: limit the number of CPU threads per worker.

    train_dataset = load_split(args.data_dir, "train", args.train_samples)
    # Horovod: DistributedSampler partitions the data among workers: num_replicas and rank.
    train_sampler = DistributedSampler(train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    test_dataset = load_split(args.data_dir, "t10k", args.test_samples)
    # Horovod: each worker scores its own share of the test set.
    test_sampler = DistributedSampler(test_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    test_loader = DataLoader(test_dataset, batch_size=args.test_batch_size, sampler=test_sampler)

    model = Net()
    # Horovod: scale the learning rate by the number of workers.
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)

    # Horovod: broadcast parameters & optimizer state from the first worker.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Horovod: wrap the optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression,
        op=hvd.Average,
        gradient_predivide_factor=args.gradient_predivide_factor,
    )

    first_loss = None
    for epoch in range(1, args.epochs + 1):
        losses = train(epoch, model, optimizer, train_loader, train_sampler, args)
        if first_loss is None:
            first_loss = metric_average(losses[0], "first_loss")  # Horovod: over all workers.
        train_loss = metric_average(sum(losses) / len(losses), "train_loss")
        test_loss, test_accuracy = test(model, test_loader, test_sampler)

    return {
        "first_loss": first_loss,
        "train_loss": train_loss,
        "test_loss": test_loss,
        "test_accuracy": test_accuracy,
        "checksum": sum(p.detach().double().sum().item() for p in model.parameters()),
        "model": model,
        "optimizer": optimizer,
    }


if __name__ == "__main__":
    main()
