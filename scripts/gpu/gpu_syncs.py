"""The GPU kit's "syncs" phase: host reads and syncs of steady-state training steps.

    horovodrun -np 1 -H localhost:1 --gloo python scripts/gpu/gpu_syncs.py probe --json s.json

Per configuration (both schedules, float32 and float16 on the wire), every host read of a
step counted by `HostReads` (tests/parallel/host_reads.py, which test_host_syncs.py uses),
the host's waits for Horovod's collectives and, on CUDA, what
``torch.cuda.set_sync_debug_mode`` reports (it catches the synchronising calls of C++ code
too), then one step in its "error" mode.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
import warnings
from dataclasses import asdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "parallel"))
from host_reads import HostReads, repo_path

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_THIS_FILE = os.path.abspath(__file__)
_WARNINGS_FILE = os.path.abspath(warnings.__file__)


@contextlib.contextmanager
def cuda_sync_reports(mode: str = "warn"):
    """Inside: torch.cuda's sync debug mode; yields the list of (site, message) it reported.

    In "warn" mode every synchronising CUDA call of torch becomes a warning,
    caught here with the innermost caller outside torch; in "error" mode it
    raises instead (and nothing is collected).
    """
    found: list[dict] = []
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        show = warnings.showwarning

        def capture(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" not in str(message):
                return show(message, category, filename, lineno, file, line)
            site = "?"
            for entry in reversed(traceback.extract_stack()[:-1]):
                path = os.path.abspath(entry.filename)
                if path not in (_THIS_FILE, _WARNINGS_FILE) and not path.startswith(_TORCH_DIR):
                    site = f"{repo_path(path)}:{entry.lineno}"
                    code = (entry.line or "").strip()
                    break
            else:
                code = ""
            found.append({"site": site, "code": code, "message": str(message).splitlines()[0]})

        warnings.showwarning = capture
        torch.cuda.set_sync_debug_mode(mode)
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(previous)
            warnings.showwarning = show


def collective_waits():
    """Context manager counting hvd.synchronize() calls (the host waiting for a collective)."""
    import horovod.torch as hvd

    counter = {"waits": 0}
    original = hvd.synchronize

    def synchronize(handle):
        counter["waits"] += 1
        return original(handle)

    @contextlib.contextmanager
    def patched():
        hvd.synchronize = synchronize
        try:
            yield counter
        finally:
            hvd.synchronize = original

    return patched()


# --- the kit's probe ------------------------------------------------------------------------
def _summary(steps: dict[int, list[dict]]) -> list[dict]:
    """Per (site, method): the steps where it happened and how many times in all."""
    where: dict[tuple, dict] = {}
    for step, reads in sorted(steps.items()):
        for read in reads:
            key = (read["site"], read["method"])
            entry = where.setdefault(key, {**read, "steps": [], "count": 0})
            entry["count"] += 1
            if step not in entry["steps"]:
                entry["steps"].append(step)
    return sorted(where.values(), key=lambda e: (e["steps"][0], e["site"]))


def probe(args) -> dict:
    """Train `args.steps` steps per configuration; per step, every host read and sync."""
    import horovod.torch as hvd

    import horovod_powersgd as hps
    from horovod_powersgd.bench import models

    hvd.init()
    cuda = torch.cuda.is_available() and args.device != "cpu"
    if cuda:
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    device = torch.device("cuda" if cuda else "cpu")
    workload = models.workload(args.model, args.size, device)
    model = workload.model
    out = {"device": str(device), "model": workload.description, "ranks": hvd.size()}
    out["drift_check_every"] = args.drift_every
    configs = []
    for rounds in (2, 1):
        for wire in ("fp32", "fp16"):
            configs.append((rounds, wire))
    out["configs"] = []
    g = torch.Generator().manual_seed(hvd.rank())
    for rounds, wire in configs:
        sgd = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        opt = hps.DistributedOptimizer(
            sgd,
            named_parameters=model.named_parameters(),
            rank=args.rank,
            rounds=rounds,
            comm_dtype=torch.float16 if wire == "fp16" else None,
            drift_check_every=args.drift_every,
        )
        batch = workload.batch(g)
        counted: dict[int, list[dict]] = {}
        synced: dict[int, list[dict]] = {}
        waits: dict[int, int] = {}
        started = time.perf_counter()
        with HostReads() as reads, collective_waits() as counter:
            for step in range(1, args.steps + 1):
                opt.zero_grad()
                before = counter["waits"]
                with contextlib.ExitStack() as stack:
                    sync = stack.enter_context(cuda_sync_reports("warn")) if cuda else []
                    stack.enter_context(reads.recording(str(step)))
                    workload.loss(model, batch).backward()
                    opt.step()
                if cuda:
                    torch.cuda.synchronize()
                counted[step] = [asdict(r) for r in reads.by_label[str(step)]]
                synced[step] = sync
                waits[step] = counter["waits"] - before
        config = {
            "rounds": rounds,
            "wire": wire,
            "seconds": time.perf_counter() - started,
            "counted": _summary(counted),
            "cuda_sync_debug": _summary(
                {
                    s: [{**r, "method": "sync", "device": "cuda"} for r in v]
                    for s, v in synced.items()
                }
            ),
            "collective_waits_per_step": waits,
        }
        # One more step with sync debug mode "error": on a step that is no multiple of
        # a periodic check, any synchronising call raises here.
        step = args.steps + 1
        config["error_mode_step"] = step
        if cuda:
            opt.zero_grad()
            try:
                with cuda_sync_reports("error"):
                    workload.loss(model, batch).backward()
                    opt.step()
                torch.cuda.synchronize()
                config["error_mode"] = "passed"
            except RuntimeError as exc:
                config["error_mode"] = (
                    "raised: "
                    + "".join(traceback.format_exception_only(type(exc), exc))
                    .strip()
                    .splitlines()[0]
                )
                config["error_mode_traceback"] = traceback.format_exc()[-3000:]
        else:
            config["error_mode"] = "not run (no CUDA: sync debug mode is CUDA's)"
        out["configs"].append(config)
        del opt, sgd
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("probe", help="host reads and syncs of steady-state steps (horovodrun)")
    p.add_argument("--json", required=True, help="where rank 0 writes the result")
    p.add_argument("--size", default="tiny", choices=["tiny", "full"])
    p.add_argument("--model", default="resnet50", choices=["resnet50", "gpt2"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu"])
    p.add_argument("--rank", type=int, default=4, help="PowerSGD rank (default 4)")
    p.add_argument("--steps", type=int, default=21, help="steps per configuration (default 21)")
    p.add_argument(
        "--drift-every", type=int, default=20, help="drift_check_every (default 20: one check)"
    )
    args = parser.parse_args(argv)
    result = probe(args)
    import horovod.torch as hvd

    if hvd.rank() == 0:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
