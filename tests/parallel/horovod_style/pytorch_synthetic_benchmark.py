"""Synthetic benchmark, written like Horovod's examples/pytorch: a small conv net on random data.

Launch:

    cd tests/parallel/horovod_style
    python pytorch_synthetic_benchmark.py
    horovodrun -np 2 -H localhost:2 python pytorch_synthetic_benchmark.py
    mpirun -np 2 python pytorch_synthetic_benchmark.py --fp16-allreduce

This is a plain Horovod script. tests/parallel/test_horovod_scripts.py also runs it with its one
`hvd.DistributedOptimizer` call swapped for `horovod_powersgd.DistributedOptimizer` and nothing
else changed.
"""

import argparse
import statistics
import timeit

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn


def build_parser():
    parser = argparse.ArgumentParser(
        description="PyTorch synthetic benchmark (small conv net, random data)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--fp16-allreduce", action="store_true", default=False, help="fp16 compression on the wire"
    )
    parser.add_argument("--batch-size", type=int, default=32, help="input batch size per worker")
    parser.add_argument("--image-size", type=int, default=32, help="side of the random images")
    parser.add_argument("--num-classes", type=int, default=10, help="number of random labels")
    parser.add_argument(
        "--num-warmup-batches", type=int, default=2, help="batches that do not count"
    )
    parser.add_argument(
        "--num-batches-per-iter", type=int, default=4, help="batches per benchmark iteration"
    )
    parser.add_argument("--num-iters", type=int, default=3, help="benchmark iterations")
    parser.add_argument("--lr", type=float, default=0.01, help="learning rate for one worker")
    parser.add_argument("--seed", type=int, default=42, help="random seed")
    return parser


class ConvNet(nn.Module):
    """Two 3x3 convolutions (32, 64 channels) and two linear layers; 0.6M parameters at 32x32."""

    def __init__(self, num_classes, image_size):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * (image_size // 4) ** 2, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def log(text):
    # Horovod: print on the first worker only.
    if hvd.rank() == 0:
        print(text, flush=True)


def main(argv=None):
    args = build_parser().parse_args(argv)

    hvd.init()  # Horovod: initialize the library.
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # Horovod: limit the number of CPU threads per worker.

    model = ConvNet(args.num_classes, args.image_size)
    # Horovod: scale the learning rate by the number of workers.
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)

    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Horovod: wrap the optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression,
        op=hvd.Average,
    )

    # Horovod: broadcast parameters & optimizer state from the first worker.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # Fixed fake data. Horovod: a different batch on every worker.
    generator = torch.Generator().manual_seed(args.seed + hvd.rank())
    size = args.image_size
    data = torch.randn(args.batch_size, 3, size, size, generator=generator)
    target = torch.randint(0, args.num_classes, (args.batch_size,), generator=generator)
    losses = []

    def benchmark_step():
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())

    log(f"Model: ConvNet, {sum(p.numel() for p in model.parameters()):,} parameters")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of CPUs: {hvd.size()}")  # Horovod: one worker per process.

    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)

    log("Running benchmark...")
    img_secs = []
    for i in range(args.num_iters):
        elapsed = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / elapsed
        log(f"Iter #{i}: {img_sec:.1f} img/sec per CPU")
        img_secs.append(img_sec)

    img_sec_mean = statistics.mean(img_secs)
    img_sec_conf = 1.96 * statistics.pstdev(img_secs)
    log(f"Img/sec per CPU: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
    log(
        f"Total img/sec on {hvd.size()} CPU(s): "
        f"{hvd.size() * img_sec_mean:.1f} +-{hvd.size() * img_sec_conf:.1f}"
    )

    # Horovod: average the first and last losses over all workers.
    first_loss = hvd.allreduce(torch.tensor(losses[0]), name="bench.first_loss").item()
    final_loss = hvd.allreduce(torch.tensor(losses[-1]), name="bench.final_loss").item()
    log(f"Loss: {first_loss:.4f} -> {final_loss:.4f}")
    return {
        "img_sec": img_sec_mean,
        "first_loss": first_loss,
        "final_loss": final_loss,
        "checksum": sum(p.detach().double().sum().item() for p in model.parameters()),
        "model": model,
        "optimizer": optimizer,
    }


if __name__ == "__main__":
    main()
