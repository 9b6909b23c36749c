"""What PowerSGD is doing, per layer: statistics, a periodic log line, an early warning.

No Horovod here: the optimizer hands in a summing all-reduce. For every
compressed matrix M (gradient plus error feedback) a step leaves, in the
compressor's buffers, the residual e = M − (what this worker sent, times its
orthonormal partner) and the factor F it sent (Q_w, or P_w in rounds=1's odd
steps). The residual is orthogonal to what was sent, so

    ‖M‖² = ‖e‖² + ‖F‖²        relative error ‖e‖ / ‖M‖ = ‖M − P̂·Q_wᵀ‖ / ‖M‖

with no extra product, and without the cancellation of ‖M‖² − ‖F‖² when the
error is small. A step costs one norm of each gradient (in the hook, before it
is aggregated), one of each error buffer and one of each (small) factor; the
numbers stay as tensors on the device and fold into exponential moving
averages there. The host reads them only when asked (`layers()`), and every
`CHECK_EVERY` steps, when the ranks agree on them:

    bucket_ready(bucket, names, grads)  # a bucket's gradients are complete and
                              # compressed: their norms (one fused op), rounds=1
                              # also the residuals (before the factors are summed);
                              # or, apart, residuals(bucket) (rounds=1) and then
                              # gradients(names, grads) of every bucket at once
    end_step(step, ...)       # after the step (rounds=2: the residuals, a few ops
                              # per shape group); every CHECK_EVERY steps one tiny
                              # all-reduce, the detector, the warning, the log line

The early warning watches the whole model's error norm and gradient norm
(sums over the layers of the ranks' means). Before a divergence both grow
together, and fast: in every recorded run that diverged after step 100, the
gradients grew 1.7-fold or more within 20 steps while a warning was still in
time. Healthy training grows them too, but more slowly once a network has
left its initialisation, where both grow several-fold in a few dozen steps.
The rule (`growing`) asks for errors that rose at each of the last `WINDOW`
checks and grew `ERROR_GROWTH`-fold, with gradients `GRADIENT_GROWTH`-fold;
checks of the first `SETTLE_STEPS` steps of training do not count, nor a check
with fewer than `CHECK_EVERY` compressed steps in its averages (`detect`). The
runs that set these numbers are recorded in docs/results/early_warning/;
`replay` re-judges them offline (scripts/warning/warning_rules.py,
docs/results/early_warning.md). The warning names the user's line
(`warn_at_user_line`).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import warnings
from collections.abc import Callable, Iterable

import torch

from .compressor import PowerSGDCompressor

logger = logging.getLogger("horovod_powersgd")

# Ranks agree on the statistics (one all-reduce of a few numbers per layer) and
# the detector runs every this many steps, counted by the optimizer's step
# counter, which is the same on every rank.
CHECK_EVERY = 10
# Weight of the past in the moving averages: about the last 10 steps count.
EMA_DECAY = 0.9
# The detector: over the last WINDOW checks the model's error norm rose at each
# check and grew ERROR_GROWTH-fold, and its gradient norm GRADIENT_GROWTH-fold.
# 1.7x sits between the most that healthy runs' gradients grew after SETTLE_STEPS
# and the least that diverging runs' grew in time for a warning, about as far
# from either in ratio (docs/results/early_warning.md).
WINDOW = 2
ERROR_GROWTH = 1.5
GRADIENT_GROWTH = 1.7
# Checks before this step of training are left out of the detector's history:
# leaving its initialisation, a healthy network's gradients grow as fast as a
# diverging one's (up to 8x in 20 steps in the first 50).
SETTLE_STEPS = 100


# Frames whose file lies here are the library's or torch's (torch wraps every
# optimizer's step(), GradScaler.step calls it): a warning skips them all.
_NOT_THE_USER = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep for path in (__file__, torch.__file__)
)


def warn_at_user_line(message: str, category: type[Warning]) -> None:
    """Warn with the location of the first caller outside this package and torch.

    The user's `opt.step()`, `opt.synchronize()` or `scaler.step(opt)` line is
    what the user can change; a fixed stacklevel would name torch's step
    wrapper or GradScaler instead, and another frame whenever either changes.
    """
    if sys.version_info >= (3, 12):
        warnings.warn(message, category, skip_file_prefixes=_NOT_THE_USER)
        return
    # Before Python 3.12 warnings.warn cannot skip by file: count the frames
    # to the first one outside, as skip_file_prefixes does. Frame 0 is this
    # function (stacklevel 1); frame k is stacklevel k + 1.
    frame, depth = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_NOT_THE_USER):
        frame, depth = frame.f_back, depth + 1
    warnings.warn(message, category, stacklevel=depth + 1)


def _norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norms of `tensors`, as one float32 tensor, in one fused operation.

    Computed at least in float32 (16-bit norms overflow).
    """
    narrow = any(t.dtype in (torch.float16, torch.bfloat16) for t in tensors)
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32 if narrow else None)
    return torch.stack(norms).to(torch.float32)


def _with_feedback(residual: torch.Tensor, sent: torch.Tensor):
    """(‖e‖, ‖M‖) where the error buffer holds the residual e = M − (sent factor · partner)."""
    return residual, torch.sqrt(residual.square() + sent.square())


def _without_feedback(residual: torch.Tensor, sent: torch.Tensor):
    """(‖e‖, ‖M‖) where the buffer holds M itself (no error feedback)."""
    return torch.sqrt((residual.square() - sent.square()).clamp_(min=0)), residual


class ErrorGrowthWarning(UserWarning):
    """PowerSGD's error buffers and the gradients grow together, fast: divergence ahead."""


def detect(
    history: list[tuple[float, float]], step: int, start_iter: int, norms: tuple[float, float]
) -> tuple[list[tuple[float, float]], bool]:
    """One check of the detector: its history after this check, and whether to warn.

    Args:
        history: the model's (error norm, gradient norm) at the last checks that counted.
        step: the check's step (steps completed so far).
        start_iter: the plain warm-up steps (a check needs `CHECK_EVERY` compressed steps).
        norms: the model's (error norm, gradient norm) at this check.

    A check of the first `SETTLE_STEPS` steps, or with fewer than `CHECK_EVERY`
    compressed steps in its averages, leaves the history as it is and never warns.
    """
    if step < SETTLE_STEPS or step - start_iter < CHECK_EVERY:
        return history, False
    if all(math.isfinite(v) and v > 0 for v in norms):
        history = [*history, tuple(norms)][-(WINDOW + 1) :]
    return history, growing(history)


def replay(checks: Iterable[tuple[int, float | None, float | None]], start_iter: int) -> int | None:
    """The step at which a run's monitor warns, from the model's norms at every check.

    Args:
        checks: (step, error norm, gradient norm) at consecutive checks, as
            `compression_stats(per_layer=True)` returns them (None: not finite).
        start_iter: the run's plain warm-up steps.

    Returns:
        The first check's step at which `detect` fires, or None. The detector
        decides from these numbers alone, so a recorded run can be re-judged
        offline (scripts/warning/warning_rules.py, the unit tests).
    """
    history: list[tuple[float, float]] = []
    for step, error, grad in checks:
        norms = (math.nan if error is None else error, math.nan if grad is None else grad)
        history, alarm = detect(history, step, start_iter, norms)
        if alarm:
            return step
    return None


def growing(history: list[tuple[float, float]]) -> bool:
    """The alarm rule on (error norm, gradient norm) of the model at consecutive checks.

    Fires when the last ``WINDOW + 1`` pairs are finite and positive, the
    errors rose at every check and grew at least ``ERROR_GROWTH``-fold, and
    the gradients grew at least ``GRADIENT_GROWTH``-fold.

    Example:
        >>> growing([(3.1, 1.5), (4.4, 2.2), (7.8, 5.8)]), growing([(2.4, 1.3), (3.0, 1.2)])
        (True, False)
    """
    recent = history[-(WINDOW + 1) :]
    if len(recent) < WINDOW + 1 or not all(
        math.isfinite(e) and math.isfinite(g) and e > 0 and g > 0 for e, g in recent
    ):
        return False
    errors = [e for e, _ in recent]
    rising = all(later > earlier for earlier, later in zip(errors, errors[1:]))
    return (
        rising
        and errors[-1] >= ERROR_GROWTH * errors[0]
        and recent[-1][1] >= GRADIENT_GROWTH * recent[0][1]
    )


class LayerMonitor:
    """Per-layer statistics of one optimizer's compressed tensors, and what is done with them.

    Args:
        compressor: the optimizer's compressor (its buffers are read, never written).
        allreduce_sum: (float tensor, name) -> its sum over the ranks, the same on every rank.
        workers: number of ranks that sum.
        reporter: whether this rank writes the log line (rank 0 of the process set).
        log_every: log one line every this many steps (0: never).
        all_names: the layers the ranks' statistics cover together, in one order on
            every rank (hierarchical PowerSGD: every share's); default the compressor's.
    """

    def __init__(
        self,
        compressor: PowerSGDCompressor,
        allreduce_sum: Callable[[torch.Tensor, str], torch.Tensor],
        *,
        workers: int,
        reporter: bool,
        log_every: int = 0,
        all_names: list[str] | None = None,
    ):
        self.compressor = compressor
        self.start_iter = compressor.config.start_iter
        self.allreduce_sum = allreduce_sum
        self.workers = workers
        self.reporter = reporter
        self.log_every = log_every
        self.own = compressor.compressed_names  # the layers this rank compresses
        # The layers of the agreed statistics: a rank without a value of one (another
        # share's) sends none, and the mean is over the ranks that have one.
        self.names = self.own if all_names is None else list(all_names)
        feedback = compressor.config.error_feedback
        self._error_and_matrix = _with_feedback if feedback else _without_feedback
        self._index = {name: j for j, name in enumerate(self.names)}
        self._info = {name: compressor.layer_info(name) for name in self.own}
        count = len(self.names)
        device = self._device()
        # --- this step, per layer: norms of the local gradient, the residual, the factor
        self._norms = torch.zeros(3, count, device=device)
        self._order: dict[tuple, torch.Tensor] = {}
        # --- moving averages, per layer: relative error, ‖e‖, ‖g‖, and the weight of
        # the steps that counted (the averages are divided by it: no bias towards 0)
        self._ema = torch.zeros(4, count, device=device)
        # --- agreed over the ranks at the last check (host floats) --------------------
        self.checked_step: int | None = None
        self._agreed: list[tuple[float, float, float]] = []  # relative error, ‖e‖, ‖e‖/‖g‖
        self._model = (math.nan, math.nan)  # the model's ‖e‖ and ‖g‖ (over all layers)
        # The model's (‖e‖, ‖g‖) at the last checks that count (the detector's state).
        self._history: list[tuple[float, float]] = []
        self.warned = False

    def reset(self) -> None:
        """Forget the averages and the detector's history: the state they described is gone.

        After `load_state_dict` or after taking another rank's state, the error
        buffers belong to another trajectory (or start at zero): averages of
        the steps before would describe, and warn about, what no longer exists.
        Whether this rank warned already is kept (one warning per run).
        """
        self._norms.zero_()
        self._ema.zero_()
        self.checked_step = None
        self._agreed = []
        self._model = (math.nan, math.nan)
        self._history = []

    def _device(self) -> torch.device:
        if not self.own:
            return torch.device("cpu")
        return self.compressor.step_views(self.own[0])[0].device

    # --- every step ------------------------------------------------------------------
    def _indices(self, names) -> torch.Tensor:
        key = tuple(names)
        if key not in self._order:  # names -> their indices, made once on the device
            self._order[key] = torch.tensor([self._index[n] for n in names], device=self._device())
        return self._order[key]

    def bucket_ready(self, bucket, names: list[str], grads: list[torch.Tensor]) -> None:
        """Note the local gradients of a bucket's compressed layers (rounds=1: its residuals).

        `names`, `grads`: the bucket's compressed layers (not none) and their gradients.

        Call once the bucket's gradients are all compressed and before its
        factors are sent (rounds=1 sums them in place).
        """
        self.gradients(names, grads)
        if self.compressor.config.rounds == 1:
            self._note_residuals(bucket, errors=False)

    def gradients(self, names: list[str], grads: list[torch.Tensor]) -> None:
        """Note the local gradients of compressed layers (one fused norm): any time between
        their compression and their aggregation (the flat reducer: all of a step's at once)."""
        self._norms[0].index_copy_(0, self._indices(names), _norms(grads))

    def residuals(self, bucket) -> None:
        """rounds=1: note a bucket's factors before they are summed in place (`bucket_ready`
        with `gradients` apart); its residuals wait in the error buffers until the step's
        end, where every bucket's are noted at once."""
        self._note_residuals(bucket, errors=False)

    def compressed(self, name: str, grad: torch.Tensor | None) -> None:
        """One layer's `bucket_ready` (rounds=1: the factors of its whole bucket)."""
        grad = torch.zeros((), device=self._norms.device) if grad is None else grad
        bucket = self.compressor.bucket_of(name)
        self.bucket_ready(bucket, [name], [grad])

    def _note_residuals(self, bucket=None, errors: bool = True, factors: bool = True) -> None:
        """‖e‖ and ‖F‖ of every matrix of `bucket` (None: all), each in one fused operation."""
        views = list(self.compressor.group_views(bucket))  # never empty where it is called
        index = self._indices([name for names, _, _ in views for name in names])
        if errors:
            self._norms[1].index_copy_(0, index, _norms([e for _, es, _ in views for e in es]))
        if factors:
            self._norms[2].index_copy_(0, index, _norms([f for _, _, fs in views for f in fs]))

    def end_step(self, step: int, compressed: bool, totals: Callable[[], dict]) -> None:
        """Fold a finished step in; at checks agree, detect and warn; log when due.

        Args:
            step: steps completed so far (equal on every rank).
            compressed: whether this step was compressed (else plain warm-up).
            totals: the optimizer's `compression_stats` (for the log line).
        """
        if compressed and self.names:
            # On the device only, a segment of the compressor's step (graphs.py: captured
            # with the others where cuda_graphs is on).
            self.compressor.graphs.run("statistics", self._fold, self.compressor.statics)
            if step % CHECK_EVERY == 0:
                self._check(step)
        if self.reporter and self.log_every and step % self.log_every == 0:
            logger.info(self.log_line(totals()))

    def _fold(self) -> None:
        """This step's norms into the moving averages."""
        if self.own:  # (hierarchical: a share may compress nothing) rounds=1 noted the
            # factors before they were summed in place; the residuals are in the error
            # buffers until the next step: every bucket's in one fused norm
            self._note_residuals(factors=self.compressor.config.rounds == 2)
        grad, residual, sent = self._norms
        error, matrix = self._error_and_matrix(residual, sent)
        relative = error / matrix
        # A layer counts when it had a gradient and everything is finite (an
        # overflow step of AMP leaves NaN here: it must not stick in the average).
        valid = (grad > 0) & (matrix > 0) & torch.isfinite(relative) & torch.isfinite(grad)
        new = torch.stack([relative, error, grad, torch.ones_like(grad)])
        blended = self._ema * EMA_DECAY + new * (1 - EMA_DECAY)
        torch.where(valid, blended, self._ema, out=self._ema)

    # --- across ranks, every CHECK_EVERY steps ----------------------------------------
    def _averages(self) -> torch.Tensor:
        """(3, L): this rank's moving averages of relative error, ‖e‖ and ‖g‖ (NaN: none yet)."""
        weight = self._ema[3]
        return torch.where(weight > 0, self._ema[:3] / weight, torch.full_like(weight, math.nan))

    def _check(self, step: int) -> None:
        """One small sum over the ranks; then every rank holds the same numbers and decides alike.

        What is summed: each layer's averages (with a count of the ranks that
        have one, so a rank without a value does not pull the mean to 0), the
        detector's history (a rank that joined later may hold another one) and
        whether a rank has warned already.
        """
        local = self._averages()
        history = torch.tensor(self._padded_history(), dtype=torch.float32, device=local.device)
        values = torch.cat([local.flatten(), history])
        known = torch.isfinite(values)
        message = torch.cat(
            [
                torch.where(known, values, torch.zeros_like(values)),
                known.float(),
                torch.tensor([float(self.warned)], device=local.device),
            ]
        )
        summed = self.allreduce_sum(message, "stats").tolist()
        size = values.numel()
        sums, counts = summed[:size], summed[size : 2 * size]
        mean = [s / c if c else math.nan for s, c in zip(sums, counts)]
        count = len(self.names)
        relative, error, grad = mean[:count], mean[count : 2 * count], mean[2 * count : 3 * count]
        self._agreed = [(r, e, _ratio(e, g)) for r, e, g in zip(relative, error, grad)]
        known_layers = [(e, g) for e, g in zip(error, grad) if math.isfinite(e + g)]
        self._model = (
            math.sqrt(sum(e * e for e, _ in known_layers)),
            math.sqrt(sum(g * g for _, g in known_layers)),
        )
        flat = mean[3 * count :]
        pairs = zip(flat[0::2], flat[1::2])
        history = [(e, g) for e, g in pairs if math.isfinite(e) and math.isfinite(g)]
        self._history, alarm = detect(history, step, self.start_iter, self._model)
        self.checked_step = step
        self.warned = summed[-1] > 0
        if not self.warned and alarm:
            self.warned = True
            warn_at_user_line(self._warning_text(step), ErrorGrowthWarning)

    def _padded_history(self) -> list[float]:
        """The history as a fixed-length list (NaN in front), so every rank sends as many."""
        padding = [math.nan] * 2 * (WINDOW + 1 - len(self._history))
        return padding + [value for pair in self._history for value in pair]

    def _warning_text(self, step: int) -> str:
        config = self.compressor.config
        worst = sorted(
            ((name, e, r) for name, (r, e, _) in zip(self.names, self._agreed) if e > 0),
            key=lambda row: -row[1],
        )[:3]
        layers = ", ".join(f"{name} {e:.3g} (relative error {r:.2f})" for name, e, r in worst)
        tries = [f"a higher rank (now {config.rank})"]
        if config.rounds == 1:
            tries.append("rounds=2")
        tries += ["a lower learning rate", "more plain warm-up steps (start_iter)"]
        errors = " -> ".join(f"{e:.3g}" for e, _ in self._history)
        grads = " -> ".join(f"{g:.3g}" for _, g in self._history)
        return (
            f"PowerSGD's error buffers and gradients grow together: over steps "
            f"{step - WINDOW * CHECK_EVERY}-{step} the error norm went {errors} and the "
            f"gradient norm {grads} (mean of {self.workers} ranks), the pattern measured "
            f"before training diverged. Largest errors: {layers}. Try "
            f"{', '.join(tries[:-1])} or {tries[-1]}."
        )

    # --- reading -----------------------------------------------------------------------
    def worst_layers(self, count: int) -> list[tuple[str, float, float]]:
        """(name, relative error, error ratio) of the `count` layers with the largest
        relative error, averaged over the ranks at the last check."""
        rows = [(n, r, q) for n, (r, _, q) in zip(self.names, self._agreed) if math.isfinite(r)]
        rows.sort(key=lambda row: -row[1])
        return rows[:count]

    def model_norms(self) -> tuple[float | None, float | None]:
        """The whole model's (‖e‖, ‖g‖), mean of the ranks at the last check (None: none yet)."""
        return tuple(_none_if_nan(value) for value in self._model)

    def layers(self) -> list[dict]:
        """Per compressed layer: structure, this rank's averages, the ranks' mean at the check."""
        local = self._averages().tolist()  # the one host read
        out = []
        for name in self.own:
            j = self._index[name]
            relative, error, grad = (local[i][j] for i in range(3))
            agreed = self._agreed[j] if self._agreed else (math.nan, math.nan, math.nan)
            out.append(
                {
                    "name": name,
                    **self._info[name],
                    "relative_error": _none_if_nan(relative),
                    "error_ratio": _none_if_nan(_ratio(error, grad)),
                    "avg_relative_error": _none_if_nan(agreed[0]),
                    "avg_error_ratio": _none_if_nan(agreed[2]),
                }
            )
        return out

    def log_line(self, totals: dict) -> str:
        """The periodic log line: steps, ratio, bytes, the worst layers by relative error."""
        steps = totals["steps"]
        line = (
            f"step {steps}: compression {totals['ratio']:.1f}x, "
            f"{_human_bytes(totals['bytes_sent'])} sent "
            f"({_human_bytes(totals['bytes_sent'] / max(steps, 1))}/step)"
        )
        if self.checked_step is None:
            return line + "; no compressed step checked yet"
        worst = ", ".join(
            f"{name} {relative:.3f} (error/grad {ratio:.2f})"
            for name, relative, ratio in self.worst_layers(3)
        )
        error, grad = self._model
        return (
            f"{line}; error/grad {_ratio(error, grad):.2f}; worst relative error "
            f"(mean of {self.workers} ranks, step {self.checked_step}): {worst}"
        )


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else math.nan


def _none_if_nan(value: float) -> float | None:
    return None if math.isnan(value) else value


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError
