"""Ops a steady-state step dispatches: the CPU proxy for kernel launches on a GPU.

On a GPU every aten op the library dispatches is a kernel launch (about 5 us on
an H200, whatever its size: docs/gpu.md), so the number of ops per step is what
PowerSGD's local work costs there. This counts them on any device with
`TorchDispatchMode`, for a model with ResNet-50's parameter shapes (54 matrices,
107 vectors, 25.6 M parameters), with this library's optimizer and with
Horovod's on the same model, and reports the difference: the library's ops.

    python -m horovod_powersgd.bench.dispatch --ranks 4,32 --rounds 2,1 \
        --orthogonalize householder,cholesky

One process is enough (Horovod at size 1; under mpirun every rank counts its
own). The "local work" time is the CPU time of the library's step over
Horovod's, median of the steps timed.

Ops are not kernels: a view launches none, and a CUDA linear-algebra op may loop
over its batch (`kernels_of`), so each row also counts the kernels a CUDA step
would launch at least, the GPU cost of the eager local work. The counted step takes
the paths a GPU step takes (`as_on_an_accelerator`: where the CPU reads a flag on the
host, e.g. whether a factor is finite, a GPU computes both ways on the device).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import graphs
from . import models


def resnet50_shapes() -> list[tuple[int, ...]]:
    """The parameter shapes of torchvision's ResNet-50, in its order (bench/models.py's)."""
    return models.parameter_shapes(models.ResNet50)


class ShapesModel(torch.nn.Module):
    """Parameters of the given shapes; the loss is linear in each, so backward is cheap."""

    def __init__(self, shapes, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(s, generator=generator) * 0.01) for s in shapes
        )
        self.directions = [torch.randn(s, generator=generator) for s in shapes]

    def loss(self, step: int) -> torch.Tensor:
        # A gradient that changes from step to step: the direction scaled by the step.
        scale = 1.0 + 0.1 * (step % 7)
        return sum((w * d).sum() for w, d in zip(self.weights, self.directions)) * scale


# Ops that launch no kernel on a GPU besides views: allocations without a fill, and
# changes of a tensor's metadata.
NO_KERNEL = frozenset(
    {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view",
     "set_", "resize_", "lift_fresh"}
)  # fmt: skip
# Ops that CUDA runs matrix by matrix over a batch (cuSOLVER: `orgqr` always; SVD
# and eigh past small sizes): at least one launch a matrix. `linalg_qr`'s `geqrf` is
# one batched cuBLAS call only for n <= 256 and k >= max(2, n / 16), else one more a
# matrix; a triangular solve loops for k <= 8 matrices of 64 columns or more
# (torch's BatchLinearAlgebra.cpp and .cu, read for torch 2.13).
PER_MATRIX = frozenset(
    {"linalg_qr", "geqrf", "orgqr", "linalg_householder_product", "ormqr", "linalg_svd",
     "_linalg_svd", "linalg_eigh", "_linalg_eigh", "linalg_lstsq", "linalg_inv_ex"}
)  # fmt: skip


def kernels_of(func, args) -> int:
    """Kernel launches a CUDA op would make, at least: 0 for a view or an allocation,
    one a matrix for `PER_MATRIX` ops (two for a QR whose `geqrf` loops too), 1 for
    everything else."""
    name = func.overloadpacket.__name__
    if func.is_view or name in NO_KERNEL:
        return 0
    if not (args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 2):
        return 1
    shape = args[0].shape
    matrices = max(math.prod(shape[:-2]), 1)
    if name in ("linalg_qr", "geqrf"):
        looped = not (shape[-2] <= 256 and matrices >= max(2, shape[-2] // 16))
        return (matrices if looped else 1) + (matrices if name == "linalg_qr" else 0)
    if name == "linalg_solve_triangular" and matrices <= 8 and shape[-1] >= 64:
        return matrices
    return matrices if name in PER_MATRIX else 1


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active, by name, and the kernels they would
    launch on CUDA (`kernels_of`)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.kernels: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if graphs.REPLAYING:  # inside a (recorded) graph: its replay is counted once
            return func(*args, **(kwargs or {}))
        name = str(func.overloadpacket.__name__)
        self.ops[name] += 1
        self.kernels[name] += kernels_of(func, args)
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def total_kernels(self) -> int:
        return sum(self.kernels.values())


def _step(model, opt, step: int) -> None:
    opt.zero_grad()
    model.loss(step).backward()
    opt.step()


@contextlib.contextmanager
def as_on_an_accelerator():
    """The library's steps take the paths they take on a GPU: no host read of a flag
    (`layout.HOST_READS_FREE` empty), so every check runs on the device as there."""
    from horovod_powersgd import layout

    before = set(layout.HOST_READS_FREE)
    layout.HOST_READS_FREE.clear()
    try:
        yield
    finally:
        layout.HOST_READS_FREE.update(before)


def measure(make_optimizer, shapes, steps: int = 6, timed: int = 5) -> dict:
    """Ops of step `steps` (after `steps` untimed ones), as on an accelerator, and the
    median CPU time of `timed` more (the CPU's own paths)."""
    model = ShapesModel(shapes)
    opt = make_optimizer(model)
    for step in range(steps):
        _step(model, opt, step)
    counter = OpCounter()
    runner = getattr(getattr(opt, "compressor", None), "graphs", None)
    replays = runner.replays if runner is not None else 0
    with as_on_an_accelerator(), counter:
        _step(model, opt, steps)
    if runner is not None and runner.replays > replays:  # a graph's replay: one launch
        counter.ops["graph_replay"] += runner.replays - replays
        counter.kernels["graph_replay"] += runner.replays - replays
    times = []
    for step in range(steps + 1, steps + 1 + timed):
        start = time.process_time()
        _step(model, opt, step)
        times.append(time.process_time() - start)
    times.sort()
    median_ms = 1e3 * times[len(times) // 2] if times else float("nan")
    return {
        "ops": counter.total,
        "by_op": dict(counter.ops),
        "kernels": counter.total_kernels,
        "kernels_by_op": dict(counter.kernels),
        "cpu_ms": median_ms,
    }


def library_ops(
    rank: int, rounds: int, shapes=None, timed: int = 5, method=None, **settings
) -> dict:
    """{"ops", "horovod_ops", "extra_ops", "cpu_ms", "extra_cpu_ms", "top"} for one setting.

    Horovod must be initialised. `timed`: steps whose CPU time is measured (0: none);
    `method`: the orthogonalisation (linalg.METHODS; None: the environment's);
    `settings` go to horovod_powersgd.DistributedOptimizer. With `cuda_graphs=True` the
    step runs through the recording runner (graphs.py), whose replays count as one
    launch each ("graph_replay"), as a CUDA graph's: the ops outside the graphs.
    """
    import horovod.torch as hvd

    import horovod_powersgd as hps
    from horovod_powersgd import linalg

    if method is not None:
        with _environment(linalg.METHOD_ENV, method):
            return library_ops(rank, rounds, shapes, timed, None, **settings)
    if settings.get("cuda_graphs") and os.environ.get(graphs.ENV) != "record":
        with _environment(graphs.ENV, "record"):
            return library_ops(rank, rounds, shapes, timed, None, **settings)

    shapes = shapes or resnet50_shapes()

    def ours(model):
        sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        return hps.DistributedOptimizer(
            sgd, named_parameters=model.named_parameters(), rank=rank, rounds=rounds, **settings
        )

    def horovods(model):
        sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        return hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())

    mine, base = measure(ours, shapes, timed=timed), measure(horovods, shapes, timed=timed)
    extra = collections.Counter(mine["by_op"])
    extra.subtract(base["by_op"])
    extra_kernels = collections.Counter(mine["kernels_by_op"])
    extra_kernels.subtract(base["kernels_by_op"])
    return {
        "rank": rank,
        "rounds": rounds,
        "method": linalg.METHOD,
        "graphs": bool(settings.get("cuda_graphs")),
        "ops": mine["ops"],
        "horovod_ops": base["ops"],
        "extra_ops": mine["ops"] - base["ops"],
        "kernels": mine["kernels"],
        "horovod_kernels": base["kernels"],
        "extra_kernels": mine["kernels"] - base["kernels"],
        "top_kernels": dict(extra_kernels.most_common(8)),
        "cpu_ms": round(mine["cpu_ms"], 2),
        "horovod_cpu_ms": round(base["cpu_ms"], 2),
        "extra_cpu_ms": round(mine["cpu_ms"] - base["cpu_ms"], 2),
        "top": dict(extra.most_common(8)),
    }


@contextlib.contextmanager
def _environment(name: str, value: str):
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="4,32", help="PowerSGD ranks (default: 4,32)")
    parser.add_argument("--rounds", default="2,1", help="schedules (default: 2,1)")
    parser.add_argument(
        "--orthogonalize", default="householder,cholesky",
        help="orthogonalisation methods (default: householder,cholesky)",
    )  # fmt: skip
    parser.add_argument(
        "--graphs", default="off,on",
        help="eager, and/or cuda_graphs=True through the recording runner: the launches "
        "outside the graphs, each replay one (default: off,on)",
    )  # fmt: skip
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    import horovod.torch as hvd

    hvd.init()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = [
        library_ops(int(rank), int(rounds), method=method, cuda_graphs=graphed == "on")
        for graphed in args.graphs.split(",")
        for method in args.orthogonalize.split(",")
        for rounds in args.rounds.split(",")
        for rank in args.ranks.split(",")
    ]
    if hvd.rank() == 0:
        print(
            "ResNet-50's shapes, one steady-state step, over Horovod's optimizer (CPU; no "
            "CPU time with graphs: the recording runner's own Python is not a GPU's)"
        )
        print(
            "| graphs | orthogonalisation | rank | rounds | ops over Horovod's | CUDA kernels "
            "over Horovod's (at least; graphs: outside them) | Horovod's step: ops / kernels "
            "| CPU ms over Horovod's |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for row in rows:
            print(
                f"| {'on' if row['graphs'] else 'off'} | {row['method']} | {row['rank']} "
                f"| {row['rounds']} | {row['extra_ops']} | "
                f"{row['extra_kernels']} | {row['horovod_ops']} / {row['horovod_kernels']} "
                f"| {'-' if row['graphs'] else format(row['extra_cpu_ms'], '.1f')} |"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
