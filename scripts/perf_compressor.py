"""Time the compressor's phases per step on one core, optionally against an older revision.

Single process, no Horovod: the local PowerSGD math of one training step
(begin_step, compress every layer, project, update_error, decompress) on random
gradients of a benchmark model. With ``--baseline-rev`` the compressor.py of
that git revision runs in the same process, step for step interleaved with the
working tree's, so both see the same machine load.

    python scripts/perf_compressor.py --model resnet18 --rank 2
    python scripts/perf_compressor.py --model lstm --rank 4 --baseline-rev 8ea5326
    python scripts/perf_compressor.py --model resnet18 --rank 2 --compare-rounds
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from horovod_powersgd.bench.models import MODELS
from horovod_powersgd.compressor import PowerSGDCompressor, local_step
from horovod_powersgd.config import PowerSGDConfig

PHASES = ("compress", "project", "update_error", "decompress", "total")


def load_revision(rev: str, tmp: Path):
    """The PowerSGDCompressor class of compressor.py at git revision `rev`."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(
        ["git", "show", f"{rev}:horovod_powersgd/compressor.py"],
        cwd=root,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = tmp / "baseline_compressor.py"
    path.write_text(source.replace("from .", "from horovod_powersgd."))
    spec = importlib.util.spec_from_file_location("baseline_compressor", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.PowerSGDCompressor


def one_step(c, grads, outs, done: int) -> dict[str, float]:
    """Seconds of each phase of one worker's step: this tree's compressor through the
    package's one local-step driver (compressor.local_step, the reducer's order), an
    older revision's by hand, as that revision's reducer ran it."""
    if isinstance(c, PowerSGDCompressor):
        times = {"start": time.perf_counter()}
        c.begin_step(done=done)  # every bucket's partners at once, as the reducer
        local_step(c, None, grads, outs, done=done, partners=False, mark=_timer(times))
        ends = [times["compress"], times.get("project"), times.get("error"), times["decompress"]]
        ends = [t if t is not None else times["compress"] for t in ends]  # rounds=1
        starts = [times["start"], *ends[:-1]]
        spans = [end - start for start, end in zip(starts, ends)]
        return dict(zip(PHASES, (*spans, times["decompress"] - times["start"])))
    return _older_step(c, grads, outs, done)


def _timer(times: dict):
    def mark(segment: str) -> None:
        times[segment] = time.perf_counter()

    return mark


def _older_step(c, grads, outs, done: int) -> dict[str, float]:
    t0 = time.perf_counter()
    try:
        c.begin_step(done=done)  # the caller counts the steps
    except TypeError:  # older revisions counted them in end_step()
        c.begin_step()
    for name in c.compressed_names:
        c.compress(name, grads[name])
    t1 = time.perf_counter()
    send = getattr(c, "send_buffers", None) or c.p_buffers  # older revisions: p_buffers
    if getattr(c.config, "rounds", 2) == 1:  # the error is kept in compress already
        q = send()  # one worker: the "sum" is the buffer itself
        t2 = t3 = time.perf_counter()
    else:
        q = c.project(send())
        t2 = time.perf_counter()
        c.update_error()
        t3 = time.perf_counter()
    c.decompress(q, out=outs)
    if hasattr(c, "end_step"):  # older revisions count steps in decompress
        c.end_step()
    t4 = time.perf_counter()
    return dict(zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="resnet18")
    parser.add_argument("--rank", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--baseline-rev", help="git revision to compare against")
    parser.add_argument(
        "--compare-rounds", action="store_true", help="also time rounds=1 (the alternating step)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    named = list(MODELS[args.model][0]().named_parameters())
    grads = {n: torch.randn_like(p) for n, p in named}
    config = PowerSGDConfig(rank=args.rank)
    with tempfile.TemporaryDirectory() as tmp:
        variants = {"working tree": PowerSGDCompressor(named, config)}  # rounds=2
        if args.compare_rounds:
            one_round = PowerSGDConfig(rank=args.rank, rounds=1)
            variants["rounds=1"] = PowerSGDCompressor(named, one_round)
        if args.baseline_rev:
            old = load_revision(args.baseline_rev, Path(tmp))
            variants[args.baseline_rev] = old(named, config)
        outs = {n: torch.empty_like(grads[n]) for n in variants["working tree"].compressed_names}
        times = {v: {p: [] for p in PHASES} for v in variants}
        for step in range(args.steps + 3):
            # Alternate which variant goes first: the second one finds the
            # gradients the first one read still partly in cache.
            order = list(variants.items())
            for variant, c in order if step % 2 == 0 else reversed(order):
                for phase, seconds in one_step(c, grads, outs, step).items():
                    if step >= 3:  # the first steps warm caches and allocators
                        times[variant][phase].append(seconds)
    print(f"{args.model} rank {args.rank}, {args.threads} thread(s), median of {args.steps} steps:")
    for variant, phases in times.items():
        cells = ", ".join(f"{p} {1e3 * statistics.median(v):.1f}" for p, v in phases.items())
        print(f"  {variant:>12}: {cells} ms")


if __name__ == "__main__":
    sys.exit(main())
