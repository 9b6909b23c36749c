"""The GPU kit's "syncs" phase: host reads and syncs of steady-state training steps.

    horovodrun -np 1 -H localhost:1 --gloo python scripts/gpu/gpu_syncs.py --json s.json

Per configuration (both schedules, float32 and float16 on the wire), every host read of a
step counted by `HostReads` (tests/parallel/host_reads.py, which test_host_syncs.py uses),
the host's waits for Horovod's collectives and, on CUDA, what
``torch.cuda.set_sync_debug_mode`` reports (it catches the synchronising calls of C++ code
too), then one step in its "error" mode.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
import warnings
from dataclasses import asdict
from unittest import mock

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "parallel"))
from gpu_timing import horovod_device, main_args, write_json
from host_reads import HostReads, repo_path

STEPS = 21  # steps per configuration: the statistics twice, the drift check once
DRIFT_EVERY = 20  # drift_check_every: one check (step 20), and the one after the first
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_SKIP_FILES = (os.path.abspath(__file__), os.path.abspath(warnings.__file__))


@contextlib.contextmanager
def cuda_sync_reports(mode: str = "warn"):
    """Inside: torch.cuda's sync debug mode; yields the list of (site, message) it reported.

    In "warn" mode every synchronising CUDA call of torch becomes a warning, caught
    here with the innermost caller outside torch; in "error" mode it raises instead
    (and nothing is collected).
    """
    found: list[dict] = []
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        show = warnings.showwarning

        def capture(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" not in str(message):
                return show(message, category, filename, lineno, file, line)
            site, code = "?", ""
            for entry in reversed(traceback.extract_stack()[:-1]):
                path = os.path.abspath(entry.filename)
                if path not in _SKIP_FILES and not path.startswith(_TORCH_DIR):
                    site, code = f"{repo_path(path)}:{entry.lineno}", (entry.line or "").strip()
                    break
            found.append({"site": site, "code": code, "message": str(message).splitlines()[0]})

        warnings.showwarning = capture
        torch.cuda.set_sync_debug_mode(mode)
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(previous)
            warnings.showwarning = show


def _summary(steps: dict[int, list[dict]]) -> list[dict]:
    """Per (site, method): the steps where it happened and how many times in all."""
    where: dict[tuple, dict] = {}
    for step, reads in sorted(steps.items()):
        for read in reads:
            entry = where.setdefault((read["site"], read["method"]), {**read, "steps": []})
            entry["count"] = entry.get("count", 0) + 1
            if step not in entry["steps"]:
                entry["steps"].append(step)
    return sorted(where.values(), key=lambda e: (e["steps"][0], e["site"]))


def probe(args) -> dict:
    """Train STEPS steps per configuration; per step, every host read and sync."""
    import horovod.torch as hvd

    import horovod_powersgd as hps
    from horovod_powersgd.bench import models

    device = horovod_device(hvd)
    cuda = device.type == "cuda"
    workload = models.workload("resnet50", args.size, device)
    model = workload.model
    out = {"device": str(device), "model": workload.description, "ranks": hvd.size()}
    out["drift_check_every"], out["configs"] = DRIFT_EVERY, []
    g = torch.Generator().manual_seed(hvd.rank())
    for rounds, wire in ((2, "fp32"), (2, "fp16"), (1, "fp32"), (1, "fp16")):
        sgd = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        opt = hps.DistributedOptimizer(
            sgd,
            named_parameters=model.named_parameters(),
            rank=4,
            rounds=rounds,
            comm_dtype=torch.float16 if wire == "fp16" else None,
            drift_check_every=DRIFT_EVERY,
        )
        batch = workload.batch(g)
        counted, synced, waits = {}, {}, {}
        # Each hvd.synchronize is the host waiting for a collective's result.
        sync = mock.patch.object(hvd, "synchronize", wraps=hvd.synchronize)
        with HostReads() as reads, sync as collective_waits:
            for step in range(1, STEPS + 1):
                opt.zero_grad()
                before = collective_waits.call_count
                with contextlib.ExitStack() as stack:
                    syncs = stack.enter_context(cuda_sync_reports("warn")) if cuda else []
                    stack.enter_context(reads.recording(str(step)))
                    workload.loss(model, batch).backward()
                    opt.step()
                if cuda:
                    torch.cuda.synchronize()
                counted[step] = [asdict(r) for r in reads.by_label[str(step)]]
                synced[step] = [{**r, "method": "sync", "device": "cuda"} for r in syncs]
                waits[step] = collective_waits.call_count - before
        config = {
            "rounds": rounds,
            "wire": wire,
            "counted": _summary(counted),
            "cuda_sync_debug": _summary(synced),
            "collective_waits_per_step": waits,
            # One more step with sync debug mode "error": on a step that is no multiple of
            # a periodic check, any synchronising call raises here.
            "error_mode_step": STEPS + 1,
            "error_mode": "not run (no CUDA: sync debug mode is CUDA's)",
        }
        if cuda:
            opt.zero_grad()
            try:
                with cuda_sync_reports("error"):
                    workload.loss(model, batch).backward()
                    opt.step()
                torch.cuda.synchronize()
                config["error_mode"] = "passed"
            except RuntimeError as exc:
                first = str(exc).strip().splitlines()[0]
                config["error_mode"] = f"raised: {type(exc).__name__}: {first}"
                config["error_mode_traceback"] = traceback.format_exc()[-3000:]
        out["configs"].append(config)
        del opt, sgd
    if hvd.rank() == 0:
        write_json(args.json, out)
    return out


if __name__ == "__main__":
    probe(main_args(__doc__))
