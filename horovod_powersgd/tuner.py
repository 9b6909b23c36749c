"""rank="auto": measure this job, plan per bucket, try the best plans for real, keep up.

`Tuner` is called at the start of every step (the first gradient hook) and at
its end (in `synchronize()`, after the communication, before the wrapped
optimizer steps). `FixedRanks` is the same interface for a fixed rank, and
does nothing. The choices themselves are planner.py's. A job's life under auto,
counted in steps from the start (every rank does the same at the same step):

    measure   MEASURE_STEPS plain steps (the warm-up; with a longer `start_iter`,
              its last MEASURE_STEPS steps: the job's first steps run slower than
              its later ones, docs/scale.md): step 0 settles in; CLEAN steps time the
              step and when each bucket's gradients are final; TIMED steps wait
              for each bucket's all-reduce at once and time it (the link); PROBE
              steps run PowerSGD's local work on this step's gradients at every
              rank of the ladder, bucket by bucket, sending nothing (its cost)
    plan      the ranks' mean of all that, planner.candidates: a few plans
    try       each candidate TRIAL_STEPS steps; the first after a change is not
              timed (it allocates); the others' times, each step's ranks' mean
    settled   planner.pick_measured over the timed candidates (the preferred of
              those within the trials' noise of the fastest, planner.margin): after
              MEASURE_STEPS + TRIAL_STEPS per candidate (1-4 of them) steps,
              at most 8 + 5 · 4 = 28 (23-28 in the jobs reviewed).
    keep up   every CHECK_EVERY steps: buckets whose approximation fails (the
              statistics' relative error >= FAILING) move a rank up when the
              model keeps the step within TOLERANCE; and if the step time moved
              more than DRIFT from the settled one (the link changed), the link
              is timed again and, if the model then prefers another plan, the
              candidates are tried again; a new plan is taken only if it is
              measured faster than the current one by at least HYSTERESIS, and
              by more than the trials' noise.

Every decision after the measurements is one decision for all ranks: taken
on the first rank, from the ranks' means, and broadcast (`Tuner._shared`); a
rank's own view (its statistics, its timings, its environment) never splits
the plan. The pinned link is compared across ranks when the optimizer is built.

With a pinned link (`auto_link`, or HOROVOD_POWERSGD_LINK), the planner uses it
instead of the timed all-reduces, and the step time is not tracked (a pinned
link does not change): the plan then changes only for failing buckets.
Changing a bucket's rank keeps its error buffers and the leading columns of
its memories (compressor.set_ranks); a bucket that goes plain has its error
buffers all-reduced at once and added to this step's gradients, so nothing it
held back is lost. The plan and its measurements are in the optimizer's state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import statistics
import time

import torch

from . import planner, stepmodel
from .collectives import Hop
from .comm import first_rank
from .compressor import PowerSGDCompressor, local_step
from .config import COMM_DTYPES, PowerSGDConfig, parse_link

logger = logging.getLogger("horovod_powersgd")

LINK_ENV = "HOROVOD_POWERSGD_LINK"
# Where the first rank writes the job's measurements (stepmodel.Measurements.to_dict), once
# auto has measured: the profile `python -m horovod_powersgd.bench.scale` predicts from.
PROFILE_VARIABLE = "HOROVOD_POWERSGD_PROFILE"
CLEAN, TIMED, PROBE = (1, 2, 3), (4, 5), (6, 7)  # steps of the measure phase, by index
MEASURE_STEPS = 8
SMALL = (1,) * 3  # all-reduces of 4 bytes after the timed steps: the link's latency
LINK_NUMELS = (1, 64 * 1024, 1024 * 1024)  # a re-plan's all-reduces: 4 B, 256 KiB, 4 MiB
TRIAL_STEPS = 5
# Plans this much slower than the fastest count as as fast (measured ones: more where the
# trials' noise is more, planner.margin).
TOLERANCE = 0.03
CHECK_EVERY = 100
DRIFT = 0.25
HYSTERESIS = 0.05
FAILING = 0.98  # the statistics' mean relative error of a failing bucket's layers


class FixedRanks:
    """A fixed rank: nothing to measure or decide (the interface of `Tuner`)."""

    def __init__(self, config: PowerSGDConfig):
        self.start = config.start_iter  # the first compressed step

    def begin_step(self, state) -> None:
        """At the step's first hook: nothing to do for a fixed rank."""

    def end_step(self, state) -> None:
        """After the step's communication: nothing to do for a fixed rank."""

    def resized(self, state) -> None:
        """The number of workers changed: a fixed rank stays."""

    def state_dict(self) -> dict | None:
        return None

    def bucket_ranks(self) -> dict | None:
        """None: every bucket at the configured rank."""
        return None

    def load_state_dict(self, saved, state) -> None:
        """Nothing was saved."""

    def plan(self, state) -> list[dict]:
        return _plan_rows(state, {})


def link_setting(config: PowerSGDConfig) -> str | None:
    """The pinned link's text, unparsed: `auto_link`, else HOROVOD_POWERSGD_LINK, else None.

    The optimizer compares it across ranks (with the other settings) before
    `pinned_link` parses it, so a value set on some ranks only, or a bad one,
    fails on every rank alike instead of splitting their plans.
    """
    if not config.auto:
        return None
    return config.auto_link or os.environ.get(LINK_ENV) or None


def pinned_link(config: PowerSGDConfig) -> Hop | None:
    """The link to plan for, if pinned (the setting first, then the environment)."""
    text = link_setting(config)
    if text is None:
        return None
    try:
        bytes_per_s, latency_s = parse_link(text)
    except ValueError as error:
        source = "auto_link" if config.auto_link else LINK_ENV
        raise ValueError(f"{source}={text!r}: {error}") from None
    return Hop(latency_s=latency_s, bytes_per_s=bytes_per_s)


def profile_path(writer: bool) -> str | None:
    """The file HOROVOD_POWERSGD_PROFILE names, where this rank writes the profile, if it can.

    Only the set's first rank (`writer`) writes, so only its path is checked, when the
    optimizer is built: one that cannot be written (no such folder, a folder, no
    permission) is logged as a warning there and none is written. Logged, not raised
    nor `warnings.warn`-ed: on one rank alone that would end the job (or, under
    -W error, leave the other ranks waiting in the next collective).
    """
    path = os.environ.get(PROFILE_VARIABLE)
    if not (path and writer):
        return None
    folder = os.path.dirname(os.path.abspath(path))
    problem = (
        "it is a folder" if os.path.isdir(path)
        else f"there is no folder {folder}" if not os.path.isdir(folder)
        else f"the folder {folder} is not writable" if not os.access(folder, os.W_OK | os.X_OK)
        else "the file is not writable" if os.path.exists(path) and not os.access(path, os.W_OK)
        else None
    )  # fmt: skip
    if problem:
        logger.warning("%s=%r: %s; no profile is written", PROFILE_VARIABLE, path, problem)
        return None
    return path


def _device(state) -> torch.device:
    """Where the optimizer's parameters are (the CPU for none)."""
    return state.params[0].device if state.params else torch.device("cpu")


def _synchronize(device: torch.device) -> None:
    """Wait for the device (auto's measuring steps only: probes, and on CUDA the end of
    each clean step; never in the work of a step after them)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_event():
    """A timing event on the current CUDA stream, recorded now."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class _Recorder:
    """The optimizer's `Comm` during a measure step: notes when each bucket leaves.

    On CUDA a gradient hook runs when its kernels are queued, not when they are done
    (the host runs ahead of the device), so the host's clock would put every bucket
    at the start of backward: `event` (a CUDA event factory there, else None) marks
    each launch on the device's stream too, and `on_device` reads the device's times.

    `timed`: also time each bucket's all-reduce alone (the link). Those are
    launched and waited for in `wait`, which `Reducer.finish` calls in bucket
    order on every rank. Waiting in the gradient hook instead would wait in the
    order this rank's backward completes its buckets, which differs across
    ranks when a parameter is unused on some of them: each rank would wait on
    another bucket, for ever.
    """

    def __init__(self, comm, start: float, timed: bool, event=None):
        self.comm, self.start, self.timed, self.event = comm, start, timed, event
        self.launched: dict[str, float] = {}  # collective name -> seconds after start
        self.samples: list[tuple[str, int, float]] = []  # (name, bytes, seconds)
        self._origin = None if event is None else event()  # the step's first hook
        self._events = {}

    def __getattr__(self, name):
        return getattr(self.comm, name)

    def on_device(self, synchronize) -> tuple[dict[str, float], float]:
        """(each launch, the step's end: now) in seconds after the first hook, on the
        device's clock: its work queued up to each launch, done. Waits for the device
        (`synchronize`): a measuring step's, once."""
        end = self.event()
        synchronize()
        seconds = {n: self._origin.elapsed_time(e) / 1e3 for n, e in self._events.items()}
        return seconds, self._origin.elapsed_time(end) / 1e3

    def allreduce_async(self, tensors, name):
        self.launched[name] = time.perf_counter() - self.start
        if self.event is not None:
            self._events[name] = self.event()
        if not self.timed:
            return self.comm.allreduce_async(tensors, name)
        return _Deferred(tensors, name)

    def poll(self, handle):
        return False if isinstance(handle, _Deferred) else self.comm.poll(handle)

    def wait(self, handle):
        if not isinstance(handle, _Deferred):
            return self.comm.wait(handle)
        start = time.perf_counter()
        outputs = self.comm.wait(self.comm.allreduce_async(handle.tensors, handle.name))
        nbytes = sum(t.numel() * t.element_size() for t in handle.tensors)
        self.samples.append((handle.name, nbytes, time.perf_counter() - start))
        return outputs


class _Deferred:
    """A timed all-reduce not launched yet (see `_Recorder`)."""

    def __init__(self, tensors, name):
        self.tensors, self.name = tensors, name


class Tuner:
    """rank="auto" for one optimizer (see the module docstring).

    Args:
        config: the settings (`max_rank`, `auto_link`, `start_iter`, `rounds`).
        comm: the optimizer's collectives.
    """

    def __init__(self, config: PowerSGDConfig, comm):
        self.config, self.comm = config, comm
        self.ladder = config.ladder()
        self.pinned = pinned_link(config)
        self.profile = profile_path(comm.set_rank == 0)  # None: write none
        # The step the measure phase begins at: the last MEASURE_STEPS of the plain steps.
        self.origin = max(config.start_iter - MEASURE_STEPS, 0)
        self.start = self.origin + MEASURE_STEPS  # the first compressed step
        self.phase = "measure"
        self.measurements: stepmodel.Measurements | None = None
        # Hierarchical PowerSGD (hierarchical=True): workers per node, and the node's
        # all-reduce as timed once measured; the plan is then the node's (`model`).
        self.per_node, self.intra = None, None  # int, Hop
        self.layout: dict | None = None  # hierarchical="auto": the layout taken, and why
        self._plan_now: list[int] | None = None  # the plan taken (hierarchical: its record)
        self.candidates: list[list[int]] = []
        self.trial_steps: list[list[float]] = []  # this rank's timed steps of each candidate
        self._plain_steps: list[float] = []  # the clean steps' ranks' means: their spread too
        self.expected_s: float | None = None  # the settled plan's measured step time
        self._rebase = False  # expected_s from the first settled steps (graphs: _settle)
        self.changes = 0  # plans taken so far
        self._replan_due = False  # the number of workers changed
        self._next_check = 0
        self._reset_samples()

    def _reset_samples(self) -> None:
        self._step_start = self._last_end = None
        self._recorder: _Recorder | None = None
        self._clean_s: list[float] = []
        self._span_s: list[float] = []  # clean steps: first hook to the last bucket's arrival
        self._ready: list[dict[str, float]] = []
        self._timed: list[tuple[str, int, float]] = []
        self._probe: dict[int, dict[int, list[float]]] = {}
        self._window: list[float] = []  # step times of the current trial or check

    # --- every step -----------------------------------------------------------------------
    def begin_step(self, state) -> None:
        """At the step's first hook, before its first collective."""
        self._step_start = time.perf_counter()
        # Graphs (cuda_graphs) only for the settled plan: trials time it as it runs eagerly,
        # and each would be captured anew.
        state.compressor.graphs.paused = self.phase != "settled"
        index = state.step - self.origin
        if self.phase == "measure" and (index in CLEAN or index in TIMED):
            # On CUDA the clean steps' times are the device's (see _Recorder).
            cuda = index in CLEAN and _device(state).type == "cuda"
            event = _device_event if cuda else None
            self._recorder = _Recorder(self.comm, self._step_start, index in TIMED, event)
            state.reducer.comm = self._recorder

    def end_step(self, state) -> None:
        """After the step's communication, before the wrapped optimizer's step."""
        now = time.perf_counter()
        seconds = None if self._last_end is None else now - self._last_end
        index = state.step - 1 - self.origin  # the step just done
        for factors in state.compressor.factors:
            factors.warm = True  # this step averaged its memories
        if self._recorder is not None:
            state.reducer.comm = self.comm
            if index in CLEAN:
                launched, span = dict(self._recorder.launched), now - self._step_start
                if self._recorder.event is not None:
                    launched, span = self._recorder.on_device(lambda: _synchronize(_device(state)))
                self._clean_s.append(seconds if seconds is not None else math.nan)
                self._span_s.append(span)
                self._ready.append(launched)
            else:
                self._timed.extend(self._recorder.samples)
                if index == TIMED[-1]:  # the link's latency: all-reduces of bytes (Hop.fit)
                    timed = _time_link(self.comm, state.step, _device(state), "small", SMALL)
                    self._timed.extend((f"auto.small.{i}", *t) for i, t in enumerate(timed))
            self._recorder = None
        if self.phase == "measure":
            if index in PROBE:
                self._probe_work(state)
            if index == MEASURE_STEPS - 1:
                self._plan(state)
        elif self.phase == "try":
            self._try(state, index, seconds)
        elif self._replan_due:
            self._replan_due = False
            self._replan(state, force=True)
        elif self.phase == "settled":
            self._keep_up(state, seconds)
        self._last_end = time.perf_counter()  # the tuner's own time stays out of the next step

    def resized(self, state) -> None:
        """The number of workers changed: time the link again and plan again, at the end
        of this step (a plan changes between steps)."""
        if self.phase != "measure" and self.measurements is not None:
            self._replan_due = True

    # --- measure ----------------------------------------------------------------------------
    def _probe_work(self, state) -> None:
        """PowerSGD's local work, per bucket, at every rank of the ladder, on this step's
        gradients (aggregated: the same shapes and scales), sending nothing."""
        params = [p for p in state.params if p.grad is not None and p not in state.sparse.gathered]
        named = [(state.names[p], p) for p in params]
        bucket_of = {state.names[p]: b.index for b in state.reducer.buckets for p in b.params}
        grads = {state.names[p]: p.grad for p in params}
        scratch = {name: torch.empty_like(g) for name, g in grads.items()}
        device = _device(state)
        for rank in self.ladder:
            probe = PowerSGDCompressor(
                named, dataclasses.replace(self.config, rank=rank), bucket_of
            )
            times = self._probe.setdefault(rank, {})
            for bucket in state.reducer.buckets:
                seconds = _time_bucket(probe, bucket, grads, scratch, self.comm.size, device)
                if seconds is not None:
                    times.setdefault(bucket.index, []).append(seconds)
            # Freed before the next is built: one probe's buffers at a time, with the
            # scratch gradients about twice the model's gradients (docs/auto.md).
            del probe

    def _gather(self, state) -> tuple[stepmodel.Measurements, list[float]]:
        """The ranks' means of what this rank measured, and of each clean step's time."""
        buckets = state.reducer.buckets
        names = [f"b{b.index}.r1" for b in buckets]
        ready = [statistics.median(r.get(n, math.nan) for r in self._ready) for n in names]
        timed = [s for _, _, s in self._timed]
        options = [(r, b.index) for r in self.ladder for b in buckets]
        # The fastest of the probes of each (rank, bucket): the least disturbed.
        probes = [self._probe.get(r, {}).get(i, []) for r, i in options]
        compress = [min((c for c, _ in p), default=math.nan) for p in probes]
        total = [min((t for _, t in p), default=math.nan) for p in probes]
        spans = [statistics.median(self._clean_s), statistics.median(self._span_s)]
        clean = [*self._clean_s, *[math.nan] * len(CLEAN)][: len(CLEAN)]  # alike on all ranks
        local = [*clean, *spans, *ready, *timed, *compress, *total]
        mean = self.comm.allreduce_sum(torch.tensor(local, dtype=torch.float64), "auto.m")
        mean = (mean / self.comm.size).tolist()
        clean, mean = mean[: len(CLEAN)], mean[len(CLEAN) :]
        (step_s, span_s), mean = mean[:2], mean[2:]
        ready = mean[: len(buckets)]
        timed = mean[len(buckets) : len(buckets) + len(self._timed)]
        rest = mean[len(buckets) + len(self._timed) :]
        compress, total = rest[: len(options)], rest[len(options) :]
        samples = [(nbytes, s) for (_, nbytes, _), s in zip(self._timed, timed)]
        link = Hop.fit(samples)
        out = []
        for j, bucket in enumerate(buckets):
            tensors = _tensors(state, bucket, self.ladder)
            sizes, found = stepmodel.bucket_bytes(tensors, self.ladder, self.config.rounds), {}
            for k, (rank, index) in enumerate(options):
                if index == bucket.index and rank in sizes and total[k] == total[k]:
                    found[rank] = stepmodel.Option(compress[k], total[k], *sizes[rank])
            out.append(stepmodel.Bucket(ready[j], _plain_bytes(state, bucket), found, tensors))
        backward = max(ready) if ready else 0.0
        # The step beyond the model's part, as measured: the plain step less the span from
        # its first gradient to its last bucket's arrival. Not the step less the modelled
        # timeline: what the fitted link misses of the real one would land in it, and be
        # charged to every plan on every other link (docs/scale.md, two nodes).
        rest_s = max(step_s - span_s, 0.0) if span_s == span_s else None
        measured = stepmodel.Measurements(
            tuple(out), backward, step_s, link, self.config.rounds, rest_s, self.comm.size
        )
        return (measured if self.pinned is None else measured.with_link(self.pinned)), clean

    def _write_profile(self, trials: list[dict] | None = None) -> None:
        """The measurements (and the candidates' measured steps, once timed) to the file
        HOROVOD_POWERSGD_PROFILE names, from the first rank: the ranks' means
        (`_profile_written`: a diagnostic, never raised)."""
        if self.profile is not None:
            self.profile = _profile_written(self.profile, self.measurements, trials)

    @property
    def model(self):
        """What the planner plans: the measurements, as hierarchical PowerSGD's step on
        the job's nodes where that is the job's (`stepmodel.NodeSteps`)."""
        return self._model_of(self.measurements)

    def _model_of(self, m: stepmodel.Measurements):
        return m if self.intra is None else stepmodel.NodeSteps(m, self.per_node, self.intra)

    def _plan(self, state) -> None:
        self.measurements, self._plain_steps = self._gather(state)
        self._write_profile()
        _plan_nodes(self, state)
        if self.pinned is not None:
            # The real step times say nothing about a pinned link: the model decides.
            plan = planner.choose(self.model, self.ladder, TOLERANCE)
            self._settle(state, self._shared(plan, "auto.plan"), None)
            return
        candidates = planner.candidates(self.model, self.ladder, TOLERANCE)
        self.candidates = self._shared(candidates, "auto.plans")
        self._begin_trials(state)

    def _shared(self, decision, name: str):
        """The first rank's `decision`, on every rank: every decision after the measurements
        is one decision for all ranks. Their inputs are the ranks' means, but a mean
        need not be bitwise equal everywhere, nor is a rank's own view (its statistics,
        the time it waited): any difference would split the ranks' plans (a hang, or
        mismatched all-reduces)."""
        return self.comm.broadcast_object(decision, first_rank(self.comm.process_set), name)

    # --- try --------------------------------------------------------------------------------
    def _begin_trials(self, state, keep: list[int] | None = None) -> None:
        """Time every candidate; `keep`: the plan to keep unless another is clearly faster."""
        self.phase, self.trial_steps, self._window, self._keep = "try", [], [], keep
        self._next_trial(state)

    def _next_trial(self, state) -> None:
        self._apply(state, self.candidates[len(self.trial_steps)])
        # Its first compressed step is not timed: caches and allocators settle in it.
        self._timed_after = max(state.step, self.start) + 1

    def _try(self, state, index, seconds) -> None:
        if state.step <= self._timed_after:
            return  # still plain (start_iter), or the candidate's first step
        self._window.append(seconds)
        if len(self._window) < TRIAL_STEPS - 1:
            return
        self.trial_steps.append(self._window)
        self._window = []
        if len(self.trial_steps) < len(self.candidates):
            self._next_trial(state)
            return
        # Each timed step's ranks' mean: the job's step (the ranks wait for each other).
        local = torch.tensor(self.trial_steps, dtype=torch.float64)
        steps = (self.comm.allreduce_sum(local, "auto.t") / self.comm.size).tolist()
        seconds = [statistics.fmean(g) for g in steps]
        timed = zip(self.candidates, seconds, steps)
        self._write_profile([{"plan": p, "step_s": s, "steps_s": g} for p, s, g in timed])
        best, margin = planner.pick_measured(self.candidates, steps, TOLERANCE, [self._plain_steps])
        if self._keep is not None and self._keep in self.candidates:
            kept = seconds[self.candidates.index(self._keep)]
            if seconds[self.candidates.index(best)] > kept * (1 - max(HYSTERESIS, margin)):
                best = self._keep  # not clearly faster (nor faster by more than the noise)
        best, best_s = self._shared((best, seconds[self.candidates.index(best)]), "auto.pick")
        self._settle(state, best, best_s)

    def _settle(self, state, plan, seconds: float | None) -> None:
        """Take `plan` (its measured step time: `seconds`; None: the model's)."""
        self.phase, self._window = "settled", []
        if not self._apply(state, plan):
            self._log(state, plan)  # the last candidate tried: taken as it runs
        self.expected_s = stepmodel.predict(self.model, plan) if seconds is None else seconds
        self._next_check = state.step + CHECK_EVERY
        # With graphs the settled steps run replayed, not as the trials timed them: their
        # own time is the drift check's baseline, taken at the first check.
        self._rebase = state.compressor.graphs.graphed

    # --- keep up ----------------------------------------------------------------------------
    def _keep_up(self, state, seconds) -> None:
        if seconds is not None:
            self._window = [*self._window[-19:], seconds]
        if state.step < self._next_check:
            return
        self._next_check = state.step + CHECK_EVERY
        plan = self._current(state)
        failing = _failing_buckets(state)
        raised = plan
        if failing:
            budget = stepmodel.predict(self.model, plan) * (1 + TOLERANCE)
            raised = planner.raise_failing(self.model, plan, failing, budget)
        # The step time against the settled one, the ranks' mean (1: nothing to compare).
        ratio = 1.0
        if self.pinned is None and self._rebase:  # alike on every rank: one collective
            mine = [statistics.median(self._window), 1.0] if self._window else [0.0, 0.0]
            total = self.comm.allreduce_sum(torch.tensor(mine, dtype=torch.float64), "auto.base")
            if total[1] > 0:  # the mean over the ranks that timed steps
                self.expected_s = float(total[0] / total[1])
            self._rebase = False
        if self.pinned is None and self._window:
            ratio = statistics.median(self._window) / self.expected_s
        mean = self.comm.allreduce_sum(torch.tensor([ratio], dtype=torch.float64), "auto.drift")
        drifted = abs(math.log(float(mean[0]) / self.comm.size)) > math.log(1 + DRIFT)
        raised, drifted = self._shared((raised, drifted and self.pinned is None), "auto.check")
        if raised != plan:
            self._apply(state, raised)
        elif drifted:
            self._replan(state)

    def _replan(self, state, force: bool = False) -> None:
        """Time the link again (a few all-reduces), and try the plans the model prefers now."""
        samples = _time_link(self.comm, state.step, _device(state))
        seconds = torch.tensor([s for _, s in samples], dtype=torch.float64)
        seconds = (self.comm.allreduce_sum(seconds, "auto.link") / self.comm.size).tolist()
        link = self.pinned or Hop.fit([(b, s) for (b, _), s in zip(samples, seconds)])
        plans = planner.candidates(
            self._model_of(self.measurements.with_link(link)), self.ladder, TOLERANCE
        )
        current = self._current(state)
        plans = None if not force and plans[0] == current else plans
        link, plans = self._shared((link, plans), "auto.replan")
        self.measurements = self.measurements.with_link(link)
        if plans is None:
            return
        self.candidates = [current, *[p for p in plans if p != current]]
        self._begin_trials(state, keep=None if force else current)

    # --- apply ------------------------------------------------------------------------------
    def bucket_ranks(self) -> dict | None:
        """Bucket index -> its rank in the plan taken (None: none taken yet). Hierarchical
        PowerSGD's statistics cover every share's layers: the plan says which they are."""
        # a bucket's index is its place in the plan (reducer.make_buckets)
        return None if self._plan_now is None else dict(enumerate(self._plan_now))

    def _current(self, state) -> list[int] | None:
        if state.hierarchy is not None:  # this rank's compressor holds its share's buckets
            return self._plan_now
        return [state.compressor.ranks[b.index] for b in state.reducer.buckets]

    def _apply(self, state, plan) -> bool:
        """Send each bucket at its rank in `plan` from the next step on; nothing is lost.

        Returns whether anything changed (and was logged)."""
        before = self._current(state)
        if list(plan) == before:
            return False
        ranks = {b.index: r for b, r in zip(state.reducer.buckets, plan)}
        old, self._plan_now = self.bucket_ranks() or {}, list(plan)
        residuals = state.compressor.set_ranks(
            {b: r for b, r in ranks.items() if b in state.compressor.ranks}
        )
        state.refresh()  # the reducer's layout and the statistics follow the new ranks
        _send_residuals(state, self.comm, residuals, old, ranks)
        self.changes += 1
        self._log(state, plan)
        return True

    def _log(self, state, plan) -> None:
        if self.comm.set_rank != 0:
            return
        step = state.step
        logger.info(
            "PowerSGD auto plan at step %d (%s): %s; expected %.1f ms a step, plain %.1f ms",
            step, "trying" if self.phase == "try" else "taken", _describe(plan),
            1e3 * stepmodel.predict(self.model, plan),
            1e3 * stepmodel.predict(self.measurements, stepmodel.uniform(self.measurements, 0)),
        )  # fmt: skip

    # --- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        m = self.measurements
        return {
            "phase": self.phase if self.phase == "settled" else "measure",
            "start": self.start,
            "expected_s": self.expected_s,
            "changes": self.changes,
            "next_check": self._next_check,
            "measurements": None if m is None else m.to_dict(),
            "layout": self.layout,
            "node": None if self.intra is None else {
                "per_node": self.per_node, "plan": self._plan_now,
                "intra": [self.intra.latency_s, self.intra.bytes_per_s],
            },
        }  # fmt: skip

    def load_state_dict(self, saved, state) -> None:
        """Resume a settled plan as it was (the compressor's ranks hold it); else measure
        again from this step."""
        self._reset_samples()
        if not saved or saved.get("phase") != "settled" or not saved.get("measurements"):
            self.phase = "measure"
            self.origin = max(state.step, self.config.start_iter - MEASURE_STEPS)
            self.start = self.origin + MEASURE_STEPS
            return
        self.phase, self.start = "settled", saved["start"]
        self.expected_s, self.changes = saved["expected_s"], saved["changes"]
        self.measurements = stepmodel.Measurements.from_dict(
            saved["measurements"], self.config.rounds
        )
        if self.pinned is not None:
            self.measurements = self.measurements.with_link(self.pinned)
        self._next_check, self.layout = saved["next_check"], saved.get("layout")
        node = saved.get("node")  # None: flat (hierarchical="auto" may have chosen it)
        self.per_node, self._plan_now, self.intra = None, None, None
        if node is not None:
            self.per_node, self._plan_now = node["per_node"], list(node["plan"])
            self.intra = Hop(*node["intra"])

    def plan(self, state) -> list[dict]:
        return _plan_rows(state, _bucket_figures(self.model, self._current(state), state))


def _profile_written(path: str, measurements, trials) -> str | None:
    """Write `measurements` (with `trials`) to `path`; returns it, or None once it failed.

    A diagnostic: a failure to write it is logged, never raised (this rank alone
    writes, so an error here would end the job, or leave the others waiting)."""
    data = measurements.to_dict()
    if trials:
        data["trials"] = trials  # bench.scale: compute under compression (docs/scale.md)
    temporary = f"{path}.tmp{os.getpid()}"  # whole or not at all
    try:
        with open(temporary, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(temporary, path)
    except OSError as error:
        logger.warning(
            "%s=%r: cannot write the profile (%s); no profile is written from now on",
            PROFILE_VARIABLE, path, error,
        )  # fmt: skip
        with contextlib.suppress(OSError):
            os.remove(temporary)
        return None
    return path


def _bucket_figures(m, plan, state) -> dict[int, dict]:
    """compression_stats()["plan"]'s figures of each bucket under `plan` on the model `m`."""
    if m is None or plan is None:
        return {}
    expected = stepmodel.predict(m, plan)
    out = {}
    for j, (bucket, rank) in enumerate(zip(m.buckets, plan)):
        option = bucket.options.get(rank)
        as_plain = stepmodel.predict(m, [*plan[:j], stepmodel.PLAIN, *plan[j + 1 :]])
        out[state.reducer.buckets[j].index] = {
            "bucket_ms": None if option is None else 1e3 * option.work_s,
            # hierarchical: a plain bucket is not planned (nor modelled)
            "saved_ms": None if m.compress_all else 1e3 * (as_plain - expected),
        }
    return out


def _plan_nodes(tuner: Tuner, state) -> None:
    """Where hierarchical PowerSGD runs or may: the node's link timed (one decision), the
    plan then the node's (`Tuner.model`); hierarchical="auto": which layout."""
    node = state.hierarchy or state.node_layout
    if node is not None:
        tuner.intra = tuner._shared(_node_link(node, state, tuner.comm), "auto.intra")
        tuner.per_node = node.local_size
        if state.hierarchy is None:
            _take_layout(tuner, state)


def _take_layout(tuner: Tuner, state) -> None:
    """hierarchical="auto" with rank="auto", the node's link timed: hierarchical PowerSGD
    from the next step on where the model expects its step shorter than flat's by more
    than TOLERANCE (`planner.hierarchical_pays`), one decision for all ranks; else flat.
    Before the first compressed step: the compressor a layout starts with loses nothing."""
    pays, flat_s, nodes_s = planner.hierarchical_pays(
        tuner.measurements, tuner.model, tuner.ladder, TOLERANCE
    )
    layout = {"hierarchical": pays, "flat_s": flat_s, "hierarchical_s": nodes_s}
    tuner.layout = layout = tuner._shared(layout, "auto.layout")
    if layout["hierarchical"]:
        state.use(state.layout_for(True))
        for factors in state.compressor.factors:
            factors.warm = True  # as the steps so far left the flat compressor's (end_step)
    else:
        tuner.intra = tuner.per_node = None
    if tuner.comm.set_rank == 0:
        logger.info(
            "PowerSGD auto layout: %s (expected %.1f ms a step flat, %.1f ms hierarchical)",
            "hierarchical" if layout["hierarchical"] else "flat",
            1e3 * layout["flat_s"], 1e3 * layout["hierarchical_s"],
        )  # fmt: skip


def _node_link(hierarchy, state, comm) -> Hop:
    """Hierarchical: the node's all-reduce, fitted to a few all-reduces inside every node
    at once (the ranks' mean)."""
    samples = _time_link(hierarchy.node, state.step, _device(state), "node")
    seconds = torch.tensor([s for _, s in samples], dtype=torch.float64)
    seconds = (comm.allreduce_sum(seconds, "auto.node") / comm.size).tolist()
    return Hop.fit([(b, s) for (b, _), s in zip(samples, seconds)])


def _send_residuals(state, comm, residuals: dict, old: dict, new: dict) -> None:
    """All-reduce what the matrices that leave compression (`old` -> `new` ranks by
    bucket) held back, into this step's gradients. Flat: every rank holds each one's.
    Hierarchical: one rank a node holds it (its share's), for its node's average:
    every rank sends every leaving matrix's (zeros where not its share's), summed,
    over the nodes: one collective that every rank makes alike."""
    leaving = sorted(residuals)
    if state.hierarchy is not None:
        compresses = state.config.compresses
        leaving = [
            state.names[p] for b in state.reducer.buckets for p in b.params
            if p not in state.reducer.skip and compresses(p.shape, old.get(b.index, 0))
            and not compresses(p.shape, new[b.index])
        ]  # fmt: skip
    if not leaving:
        return
    params = {state.names[p]: p for p in state.params}
    tensors = []
    for name in leaving:
        p = params[name]
        held = residuals.get(name, torch.zeros(p.numel(), device=p.device))
        tensors.append(held.reshape(-1).to(_compute(p.dtype)))
    tag = f"auto.residuals.{state.step}"
    if state.hierarchy is None:
        sums = comm.wait(comm.allreduce_async(tensors, tag))  # averaged
    else:
        nodes = state.hierarchy.cross_size
        sums = [t / nodes for t in comm.wait(comm.sum_async(tensors, tag))]
    for name, avg in zip(leaving, sums):
        p = params[name]
        if p.grad is not None:
            p.grad.add_(avg.to(p.grad.dtype).view_as(p.grad))


def _time_bucket(probe, bucket, grads, scratch, workers, device):
    """(compress seconds, all local seconds) of one bucket's PowerSGD step on `probe`
    (compressor.local_step: the reducer's segments, nothing sent)."""
    times = {}

    def mark(segment: str) -> None:
        if segment in ("compress", "decompress"):  # queued: wait for the device
            _synchronize(device)
            times[segment] = time.perf_counter()

    _synchronize(device)
    start = time.perf_counter()
    if not local_step(probe, bucket.index, grads, scratch, workers=workers, mark=mark):
        return None
    return times["compress"] - start, times["decompress"] - start


def _time_link(comm, step: int, device, what="link", numels=LINK_NUMELS) -> list[tuple]:
    """(bytes, seconds) of all-reduces of `numels` elements on `device` over `comm`, each
    waited for, after an untimed one that lines the ranks up. Not counted as sent."""
    comm.allreduce_sum(torch.zeros(1, device=device), f"auto.{what}.{step}.sync")
    samples = []
    for i, numel in enumerate(numels):
        tensor = torch.zeros(numel, device=device)
        start = time.perf_counter()
        comm.allreduce_sum(tensor, f"auto.{what}.{step}.{i}")
        samples.append((numel * 4, time.perf_counter() - start))
    return samples


def _tensors(state, bucket, ladder) -> tuple[stepmodel.Tensor, ...]:
    """Each of the bucket's gradients: its sizes, and its factors' bytes at every rank of
    the ladder that compresses it."""
    config, out = state.config, []
    for p in bucket.params:
        factors = {}
        size = torch.finfo(config.comm_dtype or _compute(p.dtype)).bits // 8
        for rank in ladder:
            found = stepmodel.factor_sizes(p.shape, rank, config.min_compression_rate)
            if found:
                factors[rank] = (float(found[0] * size), float(found[1] * size))
        node = p.dtype if p.dtype in COMM_DTYPES else torch.float32  # hierarchy._Pack's
        wire = float(p.numel() * _wire_size(state, p, config.comm_dtype))
        rows = p.shape[0] if p.dim() else 1  # what the node's split shares out
        out.append(
            stepmodel.Tensor(p.numel(), torch.finfo(node).bits // 8, wire, factors, rows, p.dim())
        )
    return tuple(out)


def _compute(dtype):
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _wire_size(state, p, comm_dtype) -> int:
    """Bytes per element of p's gradient on the wire, sent as it is."""
    if comm_dtype is not None:
        return torch.finfo(comm_dtype).bits // 8
    tensor, _ = state.comm.to_wire(torch.zeros(1, dtype=p.dtype), None)
    return tensor.element_size()


def _plain_bytes(state, bucket) -> float:
    return float(sum(p.numel() * _wire_size(state, p, None) for p in bucket.params))


def _failing_buckets(state) -> list[int]:
    """Positions of the buckets whose compressed layers' mean relative error >= FAILING."""
    if state.monitor is None:
        return []
    errors: dict[int, list[float]] = {}
    bucket_of = {state.names[p]: j for j, b in enumerate(state.reducer.buckets) for p in b.params}
    for layer in state.monitor.layers():
        if layer["avg_relative_error"] is not None:
            errors.setdefault(bucket_of[layer["name"]], []).append(layer["avg_relative_error"])
    return sorted(j for j, e in errors.items() if statistics.mean(e) >= FAILING)


def _describe(plan) -> str:
    return ", ".join(f"b{j} " + (f"r{r}" if r else "plain") for j, r in enumerate(plan))


def _plan_rows(state, figures: dict[int, dict]) -> list[dict]:
    """compression_stats()["plan"]: per parameter, how it travels at the next step
    (plain for all until `start_iter` ends, whatever the plan)."""
    live = state.step >= state.tuner.start
    rows = []
    for bucket in state.reducer.buckets:
        extra = figures.get(bucket.index, {"bucket_ms": None, "saved_ms": None})
        for p in bucket.params:
            name = state.names[p]
            compressed = live and state.compressor.is_compressed(name)
            rank = state.compressor.layer_info(name)["rank"] if compressed else 0
            rows.append(
                {"name": name, "bucket": bucket.index,
                 "method": "powersgd" if compressed else "plain", "rank": rank, **extra}
            )  # fmt: skip
    return rows
