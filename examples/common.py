"""What the examples share: flags, device, the optimizer switch, byte counting, metrics.

Kept to the parts that are identical in the scripts; everything that teaches
how to use Horovod or PowerSGD stays in the scripts themselves.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import shlex
import sys
import time

import horovod.torch as hvd
import torch


def add_common_args(parser: argparse.ArgumentParser, start_iter_help: str | None = None) -> None:
    """Flags that mean the same in every example.

    ``start_iter_help``: an example whose ``--start-iter`` defaults to another flag
    (None until `parse` resolves it) says which here.
    """
    parser.add_argument("--epochs", type=int, default=1, help="passes over the training set")
    parser.add_argument("--seed", type=int, default=42, help="model init, shuffling and Q seed")
    # 0 switches PowerSGD off, so the same script is the plain-Horovod baseline.
    parser.add_argument(
        "--powersgd-rank",
        type=powersgd_rank,
        default=2,
        help='PowerSGD rank r; "auto" = chosen per bucket from measurements; 0 = plain hvd '
        "all-reduce",
    )
    parser.add_argument(
        "--powersgd-max-rank", type=int, default=16, help='the highest rank "auto" may choose'
    )
    parser.add_argument(
        "--powersgd-link",
        default=None,
        help='"auto" plans for this link instead of the measured one, e.g. 50mbit or '
        "1gbit,2ms (to train with a slow link's choices on a fast one)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        choices=(1, 2),
        default=2,
        help="PowerSGD all-reduce rounds per step: 2 = P then Q, 1 = alternating",
    )
    parser.add_argument(
        "--start-iter",
        type=int,
        default=0 if start_iter_help is None else None,
        help=start_iter_help or "uncompressed steps before PowerSGD starts",
    )
    parser.add_argument(
        "--fp16-allreduce",
        action="store_true",
        default=False,
        help="send gradients (PowerSGD: P, Q and the uncompressed tensors) in float16",
    )
    parser.add_argument(
        "--no-cuda",
        action="store_true",
        default=False,
        help="train on the CPU even where a GPU is available",
    )
    parser.add_argument(
        "--min-compression-rate",
        type=float,
        default=2.0,
        help="compress a tensor only if it shrinks at least this much",
    )
    parser.add_argument(
        "--train-subset", type=int, default=0, help="use only the first N training items; 0 = all"
    )
    parser.add_argument(
        "--eval-subset", type=int, default=0, help="use only the first N evaluation items; 0 = all"
    )
    parser.add_argument(
        "--max-steps", type=int, default=0, help="stop each epoch after N steps; 0 = no limit"
    )
    parser.add_argument(
        "--json", metavar="PATH", default=None, help="write per-epoch metrics here (rank 0)"
    )
    parser.add_argument(
        "--hierarchical",
        choices=("off", "on", "auto"),
        default="off",
        help="on nodes of several workers: exact inside the node, PowerSGD between nodes, "
        "each node's compression shared by its workers (auto: on for several such nodes)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--tensorboard",
        metavar="DIR",
        default=None,
        help="write TensorBoard scalars here (rank 0): loss, metrics, bytes, per-layer error",
    )
    parser.add_argument(
        "--powersgd-log-every",
        type=int,
        default=0,
        help="rank 0 logs PowerSGD's statistics every N steps (logger horovod_powersgd); 0 = off",
    )


def powersgd_rank(text: str):
    """--powersgd-rank: "auto" or an integer >= 0."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f'must be an integer or "auto", got {text!r}') from None


def parse(parser: argparse.ArgumentParser, argv):
    args = parser.parse_args(argv)
    for flag in ("epochs", "batch_size"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    for flag in ("powersgd_rank", "start_iter", "train_subset", "eval_subset", "max_steps",
                 "powersgd_log_every"):  # fmt: skip
        value = getattr(args, flag)
        if value is not None and value != "auto" and value < 0:
            parser.error(f"--{flag.replace('_', '-')} must be >= 0")
    if getattr(args, "hierarchical", "off") != "off":
        # Horovod: hierarchical PowerSGD adds process sets after hvd.init().
        os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
    return args


def seed_everything(seed: int) -> None:
    # The same seed on every rank: identical initial weights before the broadcast
    # anyway, and identical dropout streams make runs easy to compare.
    random.seed(seed)
    torch.manual_seed(seed)


def training_device(args) -> torch.device:
    """This worker's device: the GPU of its local rank where there is one, else the CPU.

    One process per GPU. horovodrun and mpirun show every process all of its
    node's GPUs, and local rank i (the i-th process on a node) takes GPU i;
    where the launcher shows a process only its own GPU (``srun
    --gpus-per-task=1``), that one, GPU 0, is it.

    Example:
        >>> training_device(argparse.Namespace(no_cuda=True))
        device(type='cpu')
    """
    if args.no_cuda or not torch.cuda.is_available():
        return torch.device("cpu")
    visible = torch.cuda.device_count()
    index = hvd.local_rank() if visible > 1 else 0  # Horovod: this process's rank on its node.
    if index >= visible:
        raise RuntimeError(
            f"local rank {index} has no GPU of its own: this process sees {visible} GPUs; "
            "start one process per GPU on each node, or pass --no-cuda"
        )
    # Horovod: pin one GPU per process, before anything touches CUDA.
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def wire_compression(args):
    # Horovod: (optional) compression of what goes on the wire.
    return hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none


def distributed_optimizer(optimizer, model, args):
    """Wrap ``optimizer`` for data-parallel training, PowerSGD unless rank is 0."""
    if args.powersgd_rank == 0:
        # Horovod: plain averaged all-reduce of every gradient (the baseline).
        return hvd.DistributedOptimizer(
            optimizer,
            named_parameters=model.named_parameters(),
            compression=wire_compression(args),
        )
    import horovod_powersgd as hps

    if args.powersgd_log_every:
        # PowerSGD logs through Python's logging (rank 0 only); show its INFO lines.
        logging.basicConfig(format="%(name)s: %(message)s")
        logging.getLogger("horovod_powersgd").setLevel(logging.INFO)
    # Horovod + PowerSGD: the same wrapper, low-rank compressed all-reduce.
    return hps.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=wire_compression(args),
        rank=args.powersgd_rank,
        rounds=args.rounds,
        start_iter=args.start_iter,
        min_compression_rate=args.min_compression_rate,
        seed=args.seed,
        log_every=args.powersgd_log_every,
        max_rank=args.powersgd_max_rank,
        auto_link=args.powersgd_link,
        hierarchical={"off": False, "on": True, "auto": "auto"}[args.hierarchical],
    )


class CommunicationMeter:
    """Cumulative communication totals in the shape of ``compression_stats()``.

    PowerSGD counts its own bytes. Plain Horovod all-reduces every gradient
    once per step at the dtype ``compression`` sends it in, so the meter counts
    that itself.
    """

    def __init__(self, optimizer, model, compression=hvd.Compression.none):
        self.optimizer = optimizer
        self.powersgd = hasattr(optimizer, "compression_stats")
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._elements_per_step = sum(p.numel() for p in self._params)
        # Bytes at the dtype the compressor puts each gradient on the wire in.
        wire = [compression.compress(p.new_empty(0))[0] for p in self._params]
        self._bytes_per_step = sum(p.numel() * w.element_size() for p, w in zip(self._params, wire))
        self._steps = 0

    def step(self) -> None:
        """Call once after each ``optimizer.step()``."""
        self._steps += 1

    def resume(self, steps: int) -> None:
        """Count on from a checkpoint's ``totals()["steps"]`` (PowerSGD restores its own)."""
        self._steps = steps

    def totals(self) -> dict:
        if self.powersgd:
            return dict(self.optimizer.compression_stats())
        return {
            "steps": self._steps,
            "elements_uncompressed": self._steps * self._elements_per_step,
            "elements_sent": self._steps * self._elements_per_step,
            "bytes_sent": self._steps * self._bytes_per_step,
            "ratio": 1.0,
        }


class TensorBoardLog:
    """TensorBoard scalars on rank 0 (``--tensorboard DIR``), as Horovod's examples log.

    Every ``every`` steps: ``train/loss`` (rank 0's mean over those steps),
    ``comm/bytes_sent`` (per worker, so far) and ``comm/compression_ratio``;
    with PowerSGD also, per compressed layer, ``relative_error/<layer>`` and
    ``error_ratio/<layer>`` (averaged over the ranks at PowerSGD's last check),
    and with ``--powersgd-rank auto`` per layer ``rank/<layer>``, the rank it
    chose (0: sent as it is).
    The examples add their per-epoch metrics with ``scalar()``. The x axis is
    the number of training steps so far.
    """

    def __init__(self, directory: str | None, meter: CommunicationMeter, every: int = 10):
        self.meter, self.every = meter, every
        self.writer = None
        if directory and hvd.rank() == 0:  # Horovod: rank 0 alone writes the logs.
            from torch.utils.tensorboard import SummaryWriter  # needs `tensorboard`

            self.writer = SummaryWriter(directory)
        self._losses: list = []

    def train_step(self, loss) -> None:
        """Call after each step (and ``meter.step()``) with this step's loss (a tensor).

        Only rank 0 with a log reads its value: elsewhere the step does not wait
        for the device.
        """
        if self.writer is None:
            return
        self._losses.append(loss.item())
        totals = self.meter.totals()
        step = totals["steps"]
        if step % self.every:
            return
        self.scalar("train/loss", sum(self._losses) / len(self._losses), step)
        self._losses.clear()
        self.scalar("comm/bytes_sent", totals["bytes_sent"], step)
        self.scalar("comm/compression_ratio", totals["ratio"], step)
        if self.meter.powersgd:
            stats = self.meter.optimizer.compression_stats(per_layer=True)
            for row in stats.get("plan", ()):  # --powersgd-rank auto: what it chose
                self.scalar(f"rank/{row['name']}", row["rank"], step)
            for layer in stats["layers"]:
                for key, tag in (("avg_relative_error", "relative_error"),
                                 ("avg_error_ratio", "error_ratio")):  # fmt: skip
                    if layer[key] is not None:
                        self.scalar(f"{tag}/{layer['name']}", layer[key], step)

    def scalar(self, tag: str, value: float, step: int | None = None) -> None:
        if self.writer is not None and math.isfinite(value):
            step = self.meter.totals()["steps"] if step is None else step
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def epoch_communication(before: dict, after: dict) -> dict:
    """Bytes and ratio of the steps between two ``totals()``; with rank="auto" the plan."""
    sent = after["elements_sent"] - before["elements_sent"]
    uncompressed = after["elements_uncompressed"] - before["elements_uncompressed"]
    comm = {
        "steps": after["steps"] - before["steps"],
        "bytes_sent": int(after["bytes_sent"] - before["bytes_sent"]),
        "ratio": uncompressed / sent if sent else 1.0,
    }
    if "plan" in after:  # each bucket's rank at the epoch's end (0: sent as it is)
        ranks: dict[int, int] = {}
        for row in after["plan"]:
            ranks[row["bucket"]] = max(ranks.get(row["bucket"], 0), row["rank"])
        comm["plan"] = [ranks[b] for b in sorted(ranks)]
    return comm


def plan_entry(comm: dict) -> dict:
    """The epoch record's ``plan`` where rank="auto" chose one (nothing otherwise)."""
    return {"plan": comm["plan"]} if "plan" in comm else {}


def sum_across_ranks(*values, name: str) -> list:
    """Every rank's ``values`` (numbers, or 0-d tensors on the training device) summed.

    The sum is taken in float64 on the device of the tensors among them, so
    metrics summed on the GPU during an epoch are read back once, here.
    """
    device = next((v.device for v in values if torch.is_tensor(v)), torch.device("cpu"))
    stacked = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])
    # Horovod: one all-reduce sums every rank's metrics (each rank saw a shard).
    summed = hvd.allreduce(stacked, op=hvd.Sum, name=name)
    return summed.tolist()


def zero(device) -> torch.Tensor:
    """A float64 sum to add a loop's tensors to on ``device`` without waiting for it.

    float64 like the Python floats it replaces: the same sums, bit for bit.
    """
    return torch.zeros((), dtype=torch.float64, device=device)


def progress(iterable, total: int, args, desc: str):
    """A tqdm bar on rank 0; a line every 10 % where stderr is not a terminal.

    Under horovodrun or mpirun the launcher relays output line by line, so a
    bar redrawn with carriage returns would arrive as one line at the end.
    """
    if args.no_progress or hvd.rank() != 0:  # Horovod: only rank 0 reports progress.
        return iterable
    if sys.stderr.isatty():
        try:
            from tqdm import tqdm  # in the dev extra; optional

            return tqdm(iterable, total=total, desc=desc, leave=False, dynamic_ncols=True)
        except ImportError:
            pass
    return _progress_lines(iterable, total, desc)


def _progress_lines(iterable, total: int, desc: str):
    start, next_report = time.perf_counter(), 1
    for step, item in enumerate(iterable, 1):
        yield item
        if step * 10 >= next_report * total and step < total:
            elapsed = time.perf_counter() - start
            write_line(
                f"{desc}: {step}/{total} steps, {elapsed:.0f} s, "
                f"about {elapsed * (total - step) / step:.0f} s left",
                sys.stderr,
            )
            next_report = step * 10 // total + 1


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    raise AssertionError


def workers() -> str:
    return f"{hvd.size()} worker{'s' if hvd.size() > 1 else ''}"


def write_line(text: str, stream=None) -> None:
    """Write `text` and its newline to `stream` (stdout) in one write, then flush.

    horovodrun and mpirun tag each piece of a worker's output they read with its
    rank and stream. print() writes the text and the newline apart; unbuffered
    (PYTHONUNBUFFERED, as `make demo` runs) they can reach the launcher as two
    pieces, and the line then ends in a stray tag such as ``[1,0]<stderr>:``.
    """
    stream = sys.stdout if stream is None else stream
    stream.write(text + "\n")
    stream.flush()


def log(message: str) -> None:
    if hvd.rank() == 0:  # Horovod: print on rank 0 only.
        for line in message.splitlines() or [""]:
            write_line(line)


class Recorder:
    """Collects per-epoch metrics and writes them as JSON on rank 0."""

    def __init__(self, example: str, args, argv, device: torch.device):
        self.start = time.perf_counter()
        self.record = {
            "example": example,
            "command": " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or [])]),
            "args": vars(args),
            "world_size": hvd.size(),  # Horovod: number of workers.
            "device": str(device),  # rank 0's; every rank trains on its own
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "epochs": [],
        }
        self.path = args.json

    def add_epoch(self, metrics: dict) -> None:
        metrics = dict(metrics, elapsed_s=time.perf_counter() - self.start)
        self.record["epochs"].append(metrics)
        self._write()

    def resume(self, epochs: list) -> None:
        """Start from the epochs a checkpointed run recorded; the next epoch appends."""
        self.record["epochs"] = list(epochs)
        self.record.setdefault("resumed_after_epoch", []).append(len(epochs))

    def finish(self, final: dict) -> dict:
        self.record["final"] = dict(final, elapsed_s=time.perf_counter() - self.start)
        self._write()
        return self.record

    def _write(self) -> None:
        if self.path and hvd.rank() == 0:  # Horovod: one file, written by rank 0.
            directory = os.path.dirname(os.path.abspath(self.path))
            os.makedirs(directory, exist_ok=True)
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.record, f, indent=2, default=str)
            os.replace(tmp, self.path)


def mean_across_ranks(value: float, name: str) -> float:
    # Horovod: the mean of every worker's value (each rank saw a shard).
    (total,) = sum_across_ranks(value, name=name)
    return total / hvd.size()


def close(bar, start: float) -> float:
    """Ends an epoch's progress report; returns the seconds since `start`."""
    if hasattr(bar, "close"):
        bar.close()
    return time.perf_counter() - start


def log_epoch(epoch: int, metrics: str, comm: dict, wall: float) -> None:
    log(
        f"epoch {epoch}: {metrics}, sent {human_bytes(comm['bytes_sent'])} per worker, "
        f"compression {comm['ratio']:.1f}x, {wall:.1f} s"
    )


def layer_errors(optimizer) -> dict:
    """Per compressed layer: PowerSGD's relative error ‖M − P̂·Qᵀ‖/‖M‖, the ranks' moving
    average at the last check. Hierarchical: each rank knows its share's layers; all
    ranks' lists are gathered (every rank calls this)."""
    layers = optimizer.compression_stats(per_layer=True)["layers"]
    merged = {}
    for rows in hvd.allgather_object(layers, name="finish.layers"):
        for row in rows:
            merged.setdefault(row["name"], row["avg_relative_error"])
    return merged


def finish(recorder, meter, model, args, method: str, metrics: dict, headline: str) -> dict:
    """Writes the final record, prints its line; returns the record, with the model in it."""
    totals = meter.totals()
    if meter.powersgd:
        metrics = dict(metrics, relative_error=layer_errors(meter.optimizer))
    record = recorder.finish(
        dict(metrics, bytes_sent=int(totals["bytes_sent"]), ratio=totals["ratio"])
    )
    log(
        f"Final: {headline}, bytes sent {human_bytes(totals['bytes_sent'])} per worker "
        f"({int(totals['bytes_sent'])} B), compression ratio {totals['ratio']:.1f}x ({method}, "
        f"{workers()}, {args.epochs} epoch{'s' if args.epochs > 1 else ''})"
    )
    record["model"] = model
    return record


# --- language models (LSTM, transformer) ------------------------------------------------------
def lm_epoch_record(epoch, comm, train_loss, valid_ppl, test_ppl, lr, train_time, wall) -> dict:
    return {
        "epoch": epoch,
        "steps": comm["steps"],
        "train_loss": train_loss,
        "train_perplexity": math.exp(min(train_loss, 50)),
        "valid_perplexity": valid_ppl,
        "test_perplexity": test_ppl,
        "bytes_sent": comm["bytes_sent"],
        "ratio": comm["ratio"],
        "lr": lr,
        "train_time_s": train_time,
        "wall_time_s": wall,
        **plan_entry(comm),
    }


def log_lm_epoch(metrics: dict, more: str = "") -> None:
    """Prints the line of one `lm_epoch_record`."""
    log_epoch(
        metrics["epoch"],
        f"train loss {metrics['train_loss']:.3f}, valid perplexity "
        f"{metrics['valid_perplexity']:.1f}, test perplexity {metrics['test_perplexity']:.1f}"
        + more,
        metrics,
        metrics["wall_time_s"],
    )


def lm_checkpoint_extra(settings, recorder, meter, device, **more) -> dict:
    """What an LM's checkpoint holds beside the weights: enough to go on as if never stopped."""
    # On a GPU dropout draws from the device's generator, not the CPU's.
    cuda_rng = torch.cuda.get_rng_state() if device.type == "cuda" else None
    return dict(settings=settings, epochs=recorder.record["epochs"],
                meter_steps=meter.totals()["steps"], rng=torch.get_rng_state(),
                cuda_rng=cuda_rng, **more)  # fmt: skip


def lm_resume(saved, recorder, meter, path, device) -> tuple:
    """Continues the record, byte count and dropout stream of `saved` (an LM checkpoint's extra).

    Returns (first epoch to train, last validation perplexity, last test perplexity).
    """
    recorder.resume(saved["epochs"])
    meter.resume(saved["meter_steps"])
    # Dropout masks continue their stream. (.cpu(): the checkpoint may have been read
    # onto the GPU; the generators' states are CPU tensors.)
    torch.set_rng_state(saved["rng"].cpu())
    if device.type == "cuda" and saved.get("cuda_rng") is not None:
        torch.cuda.set_rng_state(saved["cuda_rng"].cpu())
    last = saved["epochs"][-1]
    log(f"resumed from {path} after epoch {len(saved['epochs'])}")
    return len(saved["epochs"]) + 1, last["valid_perplexity"], last["test_perplexity"]


def lm_final(recorder, meter, model, args, method, valid_ppl, test_ppl) -> dict:
    return finish(recorder, meter, model, args, method,
                  {"valid_perplexity": valid_ppl, "test_perplexity": test_ppl},
                  f"test perplexity {test_ppl:.1f}")  # fmt: skip
