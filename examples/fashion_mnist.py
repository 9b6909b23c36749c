"""Fashion-MNIST CNN trained with Horovod + PowerSGD gradient compression.

Launch (from the repository root):

    # one process, no launcher
    python examples/fashion_mnist.py --epochs 1
    # 2 workers, PowerSGD rank 2 (what `make demo` runs)
    horovodrun -np 2 -H localhost:2 python examples/fashion_mnist.py --powersgd-rank 2
    # the plain Horovod baseline: same script, compression off
    horovodrun -np 2 -H localhost:2 python examples/fashion_mnist.py --powersgd-rank 0
    # with MPI instead of Gloo
    mpirun -np 2 python examples/fashion_mnist.py
    # TensorBoard scalars (loss, accuracy, bytes, per-layer error) and a PowerSGD log line
    horovodrun -np 2 -H localhost:2 python examples/fashion_mnist.py \
        --tensorboard runs/fashion --powersgd-log-every 100
    # GPU nodes: one process per GPU, each trains on the GPU of its local rank
    # (--no-cuda keeps the CPU); --fp16-allreduce halves the bytes again
    horovodrun -np 8 -H node1:4,node2:4 python examples/fashion_mnist.py --fp16-allreduce

The data are the IDX files of Debian's ``dataset-fashion-mnist`` package
(/usr/share/datasets/fashion-mnist), or any copy of them via ``--data-dir``,
gzipped or not; nothing is downloaded.

The model (three 3x3 convolutions of 32/64/128 channels, then 6272 -> 256 -> 10,
1.7M parameters) is sized so compression matters: its 6272 x 256 layer holds 94 %
of the weights, and at rank 2 PowerSGD sends about 100x fewer bytes than a
plain all-reduce.
"""

from __future__ import annotations

import argparse
import gzip
import os
import struct
import sys
import time

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"
# Per-pixel mean and standard deviation of the Fashion-MNIST training images.
MEAN, STD = 0.2860, 0.3530
CLASSES = 10

# IDX type codes -> (torch dtype, bytes per element); the data are big-endian.
_IDX_TYPES = {
    0x08: (torch.uint8, 1),
    0x09: (torch.int8, 1),
    0x0B: (torch.int16, 2),
    0x0C: (torch.int32, 4),
    0x0D: (torch.float32, 4),
    0x0E: (torch.float64, 8),
}


def parse_idx(data: bytes) -> torch.Tensor:
    """Decode the bytes of one IDX file (the MNIST format) into a tensor.

    Example:
        >>> parse_idx(bytes([0, 0, 8, 1, 0, 0, 0, 2, 7, 9])).tolist()
        [7, 9]
    """
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_TYPES:
        raise ValueError("not an IDX file: bad magic number")
    dtype, width = _IDX_TYPES[data[2]]
    ndim = data[3]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError("IDX file truncated inside its header")
    shape = struct.unpack(f">{ndim}I", data[4:header])
    count = 1
    for dim in shape:
        count *= dim
    if len(data) != header + count * width:
        raise ValueError(
            f"IDX size mismatch: header says {shape} ({count * width} bytes of data), "
            f"file has {len(data) - header}"
        )
    raw = torch.frombuffer(bytearray(data[header:]), dtype=torch.uint8)
    if width > 1:
        # Big-endian on disk: reverse each element's bytes before reinterpreting.
        raw = raw.view(-1, width).flip(1).reshape(-1)
    return raw.view(dtype).reshape(shape)


def read_idx(path: str) -> torch.Tensor:
    """Read an IDX file, gzip-compressed or not (decided by content, not name)."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    try:
        return parse_idx(data)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def _find(data_dir: str, name: str) -> str:
    for candidate in (name, name + ".gz"):
        path = os.path.join(data_dir, candidate)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(
        f"{name}[.gz] not found in {data_dir}; install Debian's dataset-fashion-mnist "
        "(scripts/bootstrap.sh does) or pass --data-dir with the four IDX files"
    )


def load_split(data_dir: str, split: str, limit: int = 0) -> TensorDataset:
    """Normalised images (N, 1, 28, 28) and int64 labels of 'train' or 't10k'."""
    images = read_idx(_find(data_dir, f"{split}-images-idx3-ubyte"))
    labels = read_idx(_find(data_dir, f"{split}-labels-idx1-ubyte"))
    if images.dim() != 3 or labels.dim() != 1 or len(images) != len(labels):
        raise ValueError(
            f"{data_dir}: {split} images {tuple(images.shape)} and labels "
            f"{tuple(labels.shape)} do not match"
        )
    if limit:
        images, labels = images[:limit], labels[:limit]
    x = (images.unsqueeze(1).float() / 255 - MEAN) / STD
    return TensorDataset(x, labels.long())


class Net(nn.Module):
    """3 conv layers (32/64/128) + 6272 -> 256 -> 10; 1.7M parameters."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.conv3 = nn.Conv2d(64, 128, 3, padding=1)
        self.fc1 = nn.Linear(128 * 7 * 7, 256)
        self.fc2 = nn.Linear(256, CLASSES)
        self.dropout = nn.Dropout(0.25)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)  # 28 -> 14
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # 14 -> 7
        x = F.relu(self.conv3(x))
        x = self.dropout(F.relu(self.fc1(x.flatten(1))))
        return self.fc2(x)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Fashion-MNIST CNN with Horovod + PowerSGD",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="folder with the IDX files")
    parser.add_argument("--batch-size", type=int, default=64, help="batch size per worker")
    parser.add_argument("--lr", type=float, default=0.01, help="learning rate per worker")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    parser.add_argument("--weight-decay", type=float, default=5e-4, help="SGD weight decay")
    common.add_common_args(parser)
    return parser


def evaluate(model, loader, device) -> tuple:
    model.eval()
    loss_sum, correct, count = common.zero(device), common.zero(device), 0
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            out = model(x)
            loss_sum += F.cross_entropy(out, y, reduction="sum")
            correct += (out.argmax(1) == y).sum()
            count += len(y)
    # Horovod: every rank scored its own shard; sum them for the whole test set.
    loss_sum, correct, count = common.sum_across_ranks(loss_sum, correct, count, name="eval")
    return loss_sum / max(count, 1), correct / max(count, 1)


def main(argv=None) -> dict:
    """Train and evaluate; returns the metrics record (also written with --json)."""
    args = common.parse(build_parser(), argv)
    hvd.init()  # Horovod: initialise (a no-op when already done).
    device = common.training_device(args)  # Horovod: the GPU of this local rank, if any.
    common.seed_everything(args.seed)
    recorder = common.Recorder("fashion_mnist", args, argv, device)

    train_set = load_split(args.data_dir, "train", args.train_subset)
    test_set = load_split(args.data_dir, "t10k", args.eval_subset)
    # Horovod: each worker trains on its own 1/size shard, reshuffled every epoch.
    train_sampler = DistributedSampler(
        train_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=args.seed
    )
    # Pinned host memory lets the copies to the GPU run while it computes.
    pin = device.type == "cuda"
    train_loader = DataLoader(
        train_set, batch_size=args.batch_size, sampler=train_sampler, pin_memory=pin
    )
    # Horovod: each worker scores a disjoint shard (no padding, so the sum is exact).
    test_shard = Subset(test_set, range(hvd.rank(), len(test_set), hvd.size()))
    test_loader = DataLoader(test_shard, batch_size=1000, pin_memory=pin)

    model = Net().to(device)
    # Horovod: scale the learning rate by the number of workers (the batch grows with it).
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=args.lr * hvd.size(),
        momentum=args.momentum,
        weight_decay=args.weight_decay,
    )
    # Horovod (+ PowerSGD): average gradients across workers.
    optimizer = common.distributed_optimizer(optimizer, model, args)
    # Horovod: start every worker from rank 0's weights and optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    meter = common.CommunicationMeter(optimizer, model, common.wire_compression(args))
    board = common.TensorBoardLog(args.tensorboard, meter)  # rank 0 only
    method = f"PowerSGD rank {args.powersgd_rank}" if args.powersgd_rank else "plain all-reduce"
    common.log(
        f"Fashion-MNIST: {len(train_set)} train / {len(test_set)} test images, "
        f"{sum(p.numel() for p in model.parameters()):,} parameters, {common.workers()}, "
        f"{method}, rank 0 on {device}"
    )

    test_loss = accuracy = float("nan")
    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)  # Horovod: a new shuffle per epoch, same on all ranks.
        model.train()
        start, before = time.perf_counter(), meter.totals()
        steps_per_epoch = len(train_loader)
        if args.max_steps:
            steps_per_epoch = min(steps_per_epoch, args.max_steps)
        loss_sum = common.zero(device)  # summed where the losses are: no wait per step
        bar = common.progress(train_loader, steps_per_epoch, args, f"epoch {epoch}")
        for step, (x, y) in enumerate(bar, 1):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            meter.step()
            loss_sum += loss.detach()
            board.train_step(loss)
            if hasattr(bar, "set_postfix"):
                bar.set_postfix(loss=f"{loss.item():.3f}")
            if step == steps_per_epoch:
                break
        if hasattr(bar, "close"):
            bar.close()
        train_time = time.perf_counter() - start
        comm = common.epoch_communication(before, meter.totals())
        # Horovod: mean training loss over all workers' steps.
        (train_loss,) = common.sum_across_ranks(loss_sum / steps_per_epoch, name="train_loss")
        train_loss /= hvd.size()
        test_loss, accuracy = evaluate(model, test_loader, device)
        wall = time.perf_counter() - start
        board.scalar("test/loss", test_loss)
        board.scalar("test/accuracy", accuracy)
        recorder.add_epoch(
            {
                "epoch": epoch,
                "steps": comm["steps"],
                "train_loss": train_loss,
                "test_loss": test_loss,
                "test_accuracy": accuracy,
                "bytes_sent": comm["bytes_sent"],
                "ratio": comm["ratio"],
                "train_time_s": train_time,
                "wall_time_s": wall,
                **common.plan_entry(comm),
            }
        )
        common.log_epoch(
            epoch,
            f"train loss {train_loss:.4f}, test loss {test_loss:.4f}, "
            f"test accuracy {100 * accuracy:.2f}%",
            comm,
            wall,
        )

    board.close()
    return common.finish(recorder, meter, model, args, method,
                         {"test_loss": test_loss, "test_accuracy": accuracy},
                         f"test accuracy {100 * accuracy:.2f}%")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
