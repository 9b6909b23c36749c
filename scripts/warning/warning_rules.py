"""Judge an early-warning rule on the recorded runs, offline: false alarms and detections.

Reads the runs scripts/warning/warning_calibration.py recorded (docs/results/early_warning/
*.json) and replays each through horovod_powersgd.monitor.replay, the code path
the library's monitor runs at every check. A run counts as diverging from the
first step whose loss was non-finite, or else from the first check whose mean
loss was at least `COLLAPSE` times the lowest check mean before it (a network
can blow up and die at chance level without a NaN). A finite run whose loss
fell from its first check to its last is healthy (`kind` has the two kinds that
count in neither rate). A healthy run that warns is a false alarm; a diverging
run is detected when the warning comes at a check before the divergence, and
the table gives how many steps before.

    python scripts/warning/warning_rules.py                          # the library's rule
    python scripts/warning/warning_rules.py --set GRADIENT_GROWTH=1.3 --set SETTLE_STEPS=50
    python scripts/warning/warning_rules.py --rule my_rule.py:growing --set WINDOW=4
    python scripts/warning/warning_rules.py --check-recorded         # replay == what warned live

`--rule FILE:FUNCTION` replaces `monitor.growing` (same signature: the last
`WINDOW + 1` (error norm, gradient norm) pairs that count -> bool); `--set`
changes the module's constants (WINDOW, ERROR_GROWTH, GRADIENT_GROWTH,
SETTLE_STEPS) for this replay.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib.util
import json
import math
import os
import sys

from horovod_powersgd import monitor

RUNS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "results")
RUNS = os.path.normpath(os.path.join(RUNS, "early_warning"))
# A run whose mean loss at a check reaches this multiple of its lowest earlier
# check mean has undone its training (the healthy runs stay below 2x).
COLLAPSE = 3.0


def load_runs(directory: str = RUNS) -> list[dict]:
    """Every recorded run in `directory`, sorted by file name, each with `file` added."""
    runs = []
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        with open(path) as f:
            run = json.load(f)
        run["file"] = os.path.basename(path)
        runs.append(run)
    return runs


def divergence_step(run: dict) -> int | None:
    """The step from which the run counts as diverged (None: healthy), see the module doc."""
    if run["nonfinite_step"] is not None:
        return run["nonfinite_step"]
    lowest = math.inf
    for step, _, _, loss in run["checks"]:
        if loss is None:
            continue
        if loss >= COLLAPSE * lowest:
            return step
        lowest = min(lowest, loss)
    return None


def warning_step(run: dict) -> int | None:
    """Where monitor.replay, with the module's current rule and constants, warns on `run`.

    Only checks before the divergence are given: a warning once the loss is
    NaN is no warning.
    """
    end = divergence_step(run)
    checks = [(s, e, g) for s, e, g, _ in run["checks"] if end is None or s < end]
    return monitor.replay(checks, run["start_iter"])


def kind(run: dict) -> str:
    """healthy, diverging, plain-diverging or not-learning.

    plain-diverging: the loss was non-finite before the first compressed check,
    in the plain warm-up or within one check interval after it, as plain Horovod
    is at that learning rate: PowerSGD had not compressed a step's worth to warn
    about. not-learning: the network had no gradient at its first compressed
    check (its ReLUs died in the plain warm-up), or it stayed finite and its last
    check's mean loss is not below its first. Neither counts in the rates: no
    warning is owed, and none would be false.
    """
    first = run["checks"][0] if run["checks"] else None
    if run["nonfinite_step"] is not None and (
        first is None or run["nonfinite_step"] <= run["start_iter"] + monitor.CHECK_EVERY
    ):
        return "plain-diverging"
    if run["nonfinite_step"] is None and (first is None or not first[2]):
        return "not-learning"
    if divergence_step(run) is not None:
        return "diverging"
    losses = [loss for *_, loss in run["checks"] if loss is not None]
    return "healthy" if losses[-1] < losses[0] else "not-learning"


def closest(run: dict) -> tuple[float, float, float]:
    """How near the library's rule came to firing on `run`: (fraction, gradient, error growth).

    The growth of the model's gradient and error norms over the detector's
    history (`WINDOW` checks), at the check that counts where fraction =
    min(gradient growth / GRADIENT_GROWTH, error growth / ERROR_GROWTH) is
    largest with errors rising at every check of it: fraction >= 1 fires. A
    diverging run is read up to its warning (the growth that fired it) or, with
    none, up to its divergence. (0, 0, 0): no history filled up.
    """
    end, warned = divergence_step(run), warning_step(run)
    history, best = [], (0.0, 0.0, 0.0)
    for step, error, grad, _ in run["checks"]:
        if end is not None and step >= end:
            break
        norms = (math.nan if error is None else error, math.nan if grad is None else grad)
        history, _ = monitor.detect(history, step, run["start_iter"], norms)
        errors = [e for e, _ in history]
        if len(history) == monitor.WINDOW + 1 and all(b > a for a, b in zip(errors, errors[1:])):
            grows = history[-1][1] / history[0][1], errors[-1] / errors[0]
            fraction = min(grows[0] / monitor.GRADIENT_GROWTH, grows[1] / monitor.ERROR_GROWTH)
            best = max(best, (fraction, *grows))
        if step == warned:
            break
    return best


def judge(runs: list[dict]) -> dict:
    """Per run (file, kind, divergence, warning, lead) and the totals."""
    rows, healthy, diverging, alarms, detected, leads = [], 0, 0, 0, 0, []
    for run in runs:
        end, warned, what = divergence_step(run), warning_step(run), kind(run)
        lead = None if end is None or warned is None else end - warned
        rows.append((run["file"], what, end, warned, lead))
        if what == "healthy":
            healthy += 1
            alarms += warned is not None
        elif what == "diverging":
            diverging += 1
            if warned is not None:
                detected += 1
                leads.append(lead)
    return {
        "rows": rows,
        "healthy": healthy,
        "false_alarms": alarms,
        "diverging": diverging,
        "detected": detected,
        "leads": sorted(leads),
    }


@contextlib.contextmanager
def constants(settings: list[str]):
    """monitor's constants set from NAME=VALUE strings for the block, then restored."""
    saved = {}
    for item in settings:
        name, value = item.split("=", 1)
        if not name.isupper() or not isinstance(getattr(monitor, name, None), (int, float)):
            raise SystemExit(f"{item}: monitor has no constant {name}")
        saved.setdefault(name, getattr(monitor, name))
        setattr(monitor, name, type(saved[name])(float(value)))
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(monitor, name, value)


def load_rule(spec: str):
    """FUNCTION from FILE:FUNCTION, a candidate for monitor.growing."""
    path, function = spec.rsplit(":", 1)
    loader = importlib.util.spec_from_file_location("candidate_rule", path)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return getattr(module, function)


def check_recorded(runs: list[dict]) -> int:
    """Replay every run under the constants it was recorded with; compare with the live warning."""
    mismatches = 0
    for run in runs:
        with constants([f"{name}={value}" for name, value in run["library_rule"].items()]):
            replayed = monitor.replay([c[:3] for c in run["checks"]], run["start_iter"])
        live = run["library_warning_step"]
        mismatches += replayed != live
        verdict = "" if replayed == live else "  MISMATCH"
        print(f"{run['file']:50s} live {live}  replayed {replayed}{verdict}")
    return mismatches


def _ratio_at(run: dict, step: int | None) -> str:
    """The model's error norm over its gradient norm at the check of `step` (the warning's)."""
    for check_step, error, grad, _ in run["checks"]:
        if check_step == step and error and grad:
            return f"{error / grad:.2f}"
    return "-"


def _loss_span(run: dict) -> str:
    losses = [loss for *_, loss in run["checks"] if loss is not None]
    return f"{losses[0]:.3g} -> {losses[-1]:.3g}" if losses else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default=RUNS, help="folder of recorded runs")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--rule", default=None, metavar="FILE:FUNCTION")
    parser.add_argument(
        "--baseline",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="also replay with these constants, in a last column (repeatable)",
    )
    parser.add_argument("--check-recorded", action="store_true")
    args = parser.parse_args()
    runs = load_runs(args.runs)
    if args.check_recorded:
        sys.exit(1 if check_recorded(runs) else 0)
    if args.baseline:
        with constants(args.baseline):
            baseline = {run["file"]: warning_step(run) for run in runs}
    if args.rule:
        monitor.growing = load_rule(args.rule)
    with constants(args.set):
        result = judge(runs)
        near = {run["file"]: closest(run) for run in runs} if not args.rule else {}
    header = ["run", "kind", "steps", "loss, first -> last check", "diverged at", "warned at"]
    header += ["steps before", "error/gradient there"]
    header += ["closest: fraction (gradient, error growth)"] if near else []
    header += ["baseline warned at"] if args.baseline else []
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    by_file = {run["file"]: run for run in runs}
    for file, what, end, warned, lead in result["rows"]:
        run = by_file[file]
        cells = [file.removesuffix(".json"), what, run["steps"], _loss_span(run)]
        cells += [end or "-", warned or "-", "-" if lead is None else lead, _ratio_at(run, warned)]
        if near:
            fraction, grad, error = near[file]
            cells.append(f"{fraction:.2f} ({grad:.2f}x, {error:.2f}x)" if fraction else "-")
        if args.baseline:
            cells.append(baseline[file] or "-")
        print("| " + " | ".join(str(c) for c in cells) + " |")
    leads = result["leads"]
    print(
        f"\nfalse alarms: {result['false_alarms']} of {result['healthy']} healthy runs; "
        f"detected before divergence: {result['detected']} of {result['diverging']} diverging "
        f"runs" + (f", {leads[0]}-{leads[-1]} steps before" if leads else "")
    )
    if args.baseline:
        with constants(args.baseline):
            old = judge(runs)
        print(
            f"baseline ({' '.join(args.baseline)}): false alarms {old['false_alarms']} of "
            f"{old['healthy']}; detected {old['detected']} of {old['diverging']}"
            + (f", {old['leads'][0]}-{old['leads'][-1]} steps before" if old["leads"] else "")
        )


if __name__ == "__main__":
    main()
