"""ImageNet-style training, written like Horovod's examples/pytorch ResNet-50 example.

Launch (from the repository root):

    horovodrun -np 2 -H localhost:2 python tests/parallel/horovod_style/pytorch_imagenet.py \
        --batches-per-allreduce 2 --epochs 2
    # run it again with more epochs: it resumes from the last checkpoint rank 0 wrote
    horovodrun -np 2 -H localhost:2 python tests/parallel/horovod_style/pytorch_imagenet.py \
        --batches-per-allreduce 2 --epochs 3

The recipe of the ImageNet example at toy scale: a small residual network with batch norm on a
few thousand Fashion-MNIST images (Debian's dataset-fashion-mnist), several local sub-batches
per all-reduce, learning-rate warm-up every batch, a checkpoint written by rank 0 after each
epoch and resumed by rank 0 then broadcast. This is a plain Horovod script; tests/parallel/
test_horovod_scripts.py also runs it with its one `hvd.DistributedOptimizer` call swapped for
`horovod_powersgd.DistributedOptimizer` and nothing else changed.
"""

import argparse
import math
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
        description="PyTorch ImageNet-style example (toy scale)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--data-dir", default="/usr/share/datasets/fashion-mnist", help="folder of the IDX files"
    )
    parser.add_argument("--train-samples", type=int, default=2048, help="training images used")
    parser.add_argument("--val-samples", type=int, default=1000, help="validation images used")
    parser.add_argument(
        "--checkpoint-format",
        default="./checkpoint-{epoch}.pth.tar",
        help="checkpoint file format",
    )
    parser.add_argument(
        "--fp16-allreduce", action="store_true", default=False, help="fp16 compression on the wire"
    )
    parser.add_argument(
        "--batches-per-allreduce",
        type=int,
        default=1,
        help="local sub-batches per all-reduce; multiplies the total batch size",
    )
    parser.add_argument(
        "--gradient-predivide-factor",
        type=float,
        default=1.0,
        help="divide gradients by this before the sum, the rest after it",
    )
    parser.add_argument("--batch-size", type=int, default=32, help="sub-batch size per worker")
    parser.add_argument("--val-batch-size", type=int, default=500, help="validation batch size")
    parser.add_argument("--epochs", type=int, default=2, help="number of epochs to train")
    parser.add_argument("--base-lr", type=float, default=0.0125, help="learning rate, one worker")
    parser.add_argument("--warmup-epochs", type=float, default=1, help="epochs of lr warm-up")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    parser.add_argument("--wd", type=float, default=5e-5, help="weight decay")
    parser.add_argument("--seed", type=int, default=42, help="random seed")
    return parser


class BasicBlock(nn.Module):
    def __init__(self, channels_in, channels_out, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride, bias=False),
                nn.BatchNorm2d(channels_out),
            )

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class TinyResNet(nn.Module):
    """Stride-2 stem, two basic blocks (16 and 32 channels), global pooling, linear head."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(1, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU()
        )
        self.layer1 = BasicBlock(16, 16)  # 14 x 14
        self.layer2 = BasicBlock(16, 32, stride=2)  # 7 x 7
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def load_split(data_dir, split, samples):
    images = read_idx(os.path.join(data_dir, f"{split}-images-idx3-ubyte.gz"))[:samples]
    labels = read_idx(os.path.join(data_dir, f"{split}-labels-idx1-ubyte.gz"))[:samples]
    return TensorDataset((images.unsqueeze(1).float() / 255 - MEAN) / STD, labels.long())


class Metric:
    """Horovod: a running mean over batches and workers."""

    def __init__(self, name):
        self.name = name
        self.sum = torch.tensor(0.0)
        self.n = torch.tensor(0.0)

    def update(self, value):
        # Horovod: average this batch's value over all workers.
        self.sum += hvd.allreduce(value.detach(), name=self.name)
        self.n += 1

    @property
    def avg(self):
        return (self.sum / self.n).item()


def accuracy(output, target):
    return (output.argmax(dim=1) == target).float().mean()


def log(text):
    # Horovod: print on the first worker only.
    if hvd.rank() == 0:
        print(text, flush=True)


def main(argv=None):
    args = build_parser().parse_args(argv)
    allreduce_batch_size = args.batch_size * args.batches_per_allreduce

    hvd.init()  # Horovod: initialize the library.
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # Horovod: limit the number of CPU threads per worker.

    # If > 0, resume training from the checkpoint of that epoch.
    resume_from_epoch = 0
    for try_epoch in range(args.epochs, 0, -1):
        if os.path.exists(args.checkpoint_format.format(epoch=try_epoch)):
            resume_from_epoch = try_epoch
            break
    # Horovod: broadcast resume_from_epoch from rank 0 (which has the checkpoints) to the others.
    resume_from_epoch = hvd.broadcast(
        torch.tensor(resume_from_epoch), root_rank=0, name="resume_from_epoch"
    ).item()

    train_dataset = load_split(args.data_dir, "train", args.train_samples)
    # Horovod: DistributedSampler partitions the data among workers: num_replicas and rank.
    train_sampler = DistributedSampler(train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = DataLoader(train_dataset, batch_size=allreduce_batch_size, sampler=train_sampler)
    val_dataset = load_split(args.data_dir, "t10k", args.val_samples)
    # Horovod: each worker validates on its own share.
    val_sampler = DistributedSampler(val_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    val_loader = DataLoader(val_dataset, batch_size=args.val_batch_size, sampler=val_sampler)

    model = TinyResNet()
    # Horovod: scale the learning rate by the number of workers and local sub-batches.
    lr_scaler = args.batches_per_allreduce * hvd.size()
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=args.base_lr * lr_scaler,
        momentum=args.momentum,
        weight_decay=args.wd,
    )

    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Horovod: wrap the optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression,
        backward_passes_per_step=args.batches_per_allreduce,
        op=hvd.Average,
        gradient_predivide_factor=args.gradient_predivide_factor,
    )

    # Horovod: restore on the first worker, which broadcasts the state to the others.
    if resume_from_epoch > 0 and hvd.rank() == 0:
        checkpoint = torch.load(args.checkpoint_format.format(epoch=resume_from_epoch))
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])

    # Horovod: broadcast parameters & optimizer state from the first worker.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    start_checksum = sum(p.detach().double().sum().item() for p in model.parameters())

    # Horovod: warm the learning rate up from base_lr to base_lr * lr_scaler, batch by batch,
    # over the first warmup_epochs (https://arxiv.org/abs/1706.02677); constant after that.
    def adjust_learning_rate(epoch, batch_idx):
        progress = epoch + (batch_idx + 1) / len(train_loader)
        if progress < args.warmup_epochs:
            lr_adj = (1 + progress * (lr_scaler - 1) / args.warmup_epochs) / lr_scaler
        else:
            lr_adj = 1.0
        for param_group in optimizer.param_groups:
            param_group["lr"] = args.base_lr * lr_scaler * lr_adj

    def train(epoch):
        model.train()
        train_sampler.set_epoch(epoch)  # Horovod: the same new shuffle on all workers.
        train_loss, train_accuracy = Metric("train_loss"), Metric("train_accuracy")
        first_loss = None
        for batch_idx, (data, target) in enumerate(train_loader):
            adjust_learning_rate(epoch, batch_idx)
            optimizer.zero_grad()
            # Split the data into sub-batches of batch_size; their gradients add up locally.
            sub_batches = math.ceil(len(data) / args.batch_size)
            for i in range(0, len(data), args.batch_size):
                data_batch = data[i : i + args.batch_size]
                target_batch = target[i : i + args.batch_size]
                output = model(data_batch)
                train_accuracy.update(accuracy(output, target_batch))
                loss = F.cross_entropy(output, target_batch)
                train_loss.update(loss)
                if first_loss is None:
                    first_loss = train_loss.avg
                loss.div_(sub_batches)  # average the gradients over the sub-batches
                loss.backward()
            # Horovod: the gradients are averaged across all workers here.
            optimizer.step()
        log(
            f"Train Epoch #{epoch + 1}: loss {train_loss.avg:.4f}, "
            f"accuracy {100 * train_accuracy.avg:.2f}%"
        )
        return first_loss, train_loss.avg

    def validate(epoch):
        model.eval()
        val_loss, val_accuracy = Metric("val_loss"), Metric("val_accuracy")
        with torch.no_grad():
            for data, target in val_loader:
                output = model(data)
                val_loss.update(F.cross_entropy(output, target))
                val_accuracy.update(accuracy(output, target))
        log(
            f"Validate Epoch #{epoch + 1}: loss {val_loss.avg:.4f}, "
            f"accuracy {100 * val_accuracy.avg:.2f}%"
        )
        return val_loss.avg, val_accuracy.avg

    def save_checkpoint(epoch):
        # Horovod: only the first worker writes checkpoints.
        if hvd.rank() == 0:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(state, args.checkpoint_format.format(epoch=epoch + 1))

    first_loss = train_loss = val_loss = val_accuracy = None
    epochs_run = []
    for epoch in range(resume_from_epoch, args.epochs):
        epoch_first_loss, train_loss = train(epoch)
        if first_loss is None:
            first_loss = epoch_first_loss
        val_loss, val_accuracy = validate(epoch)
        save_checkpoint(epoch)
        epochs_run.append(epoch)

    return {
        "resume_from_epoch": resume_from_epoch,
        "epochs_run": epochs_run,
        "first_loss": first_loss,
        "train_loss": train_loss,
        "val_loss": val_loss,
        "val_accuracy": val_accuracy,
        "start_checksum": start_checksum,
        "checksum": sum(p.detach().double().sum().item() for p in model.parameters()),
        "model": model,
        "optimizer": optimizer,
    }


if __name__ == "__main__":
    main()
