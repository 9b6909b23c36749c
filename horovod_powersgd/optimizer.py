"""DistributedOptimizer: PowerSGD through Horovod collectives, as a drop-in for Horovod's.

One step, in the order it runs (rounds=2; docs/architecture.md lists each function):

    optimizer._hook(p)              every gradient's post-accumulate hook, while backward runs
      optimizer._begin_step()       at the step's first hook: agreement.Agreement.begin_step,
                                    state.begin_step -> reducer.begin ->
                                    compressor.begin_step (Q̂ = orth(Q memory))
      reducer.ready(p)              once p's bucket is complete, reducer._launch:
                                    compressor.compress_bucket (M = grad + e, P = M·Q̂ for
                                    all its matrices at once), then its first round leaves
                                    (P and the uncompressed gradients, one grouped
                                    all-reduce)
    optimizer.step()
      optimizer.synchronize()       reducer.finish: every P back (one wait each, one round
                                    trip); all projected at once and the Q round of all
                                    buckets (reducer._q_round: compressor.project_all,
                                    one grouped all-reduce, compressor.update_error while
                                    it runs, one wait); the statistics' gradient norms;
                                    then compressor.decompress_all
                                    into p.grad (grad = P̂·Q_avgᵀ); the step counter;
                                    monitor.end_step
      the wrapped optimizer's step  on the aggregated gradients
      guard.DriftGuard.check        every drift_check_every steps (and after agreeing)

rounds=1 is the same with one round: the factor each matrix sends this step
is computed in the hook (compressor.Alternating.compress) and averaged with
the bucket's uncompressed gradients; there is no second round.

Every part PowerSGD keeps (compressor, reducer, tuner, statistics, sparse
gradients, drift guard, step counter) lives in `opt.powersgd_state`
(state.PowerSGDState); this class keeps the hooks' bookkeeping and Horovod's
interface.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
import weakref
from contextlib import contextmanager

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import comm as hvd_comm
from .agreement import (
    SYNC_KEY,
    Agreement,
    ElasticHandler,
    describe_new,
    refuse_new_parameters,
    settings_agreed,
    signature,
    signature_digest,
)
from .config import PowerSGDConfig, check_groups, check_log_every, check_named_parameters
from .hierarchy import check as hierarchy_check
from .state import STATE_KEY, PowerSGDState

# Parameter -> the optimizer built last over it (weakly): an older one still alive is
# refused at its next hook, naming it (`_superseded`), instead of counting backward passes.
# (Keyed by identity: a tensor's == compares elements.)
_NEWEST = WeakIdKeyDictionary()
# Horovod's own messages, for the same mistakes.
_TOO_MANY_PASSES = (
    "Gradients were computed more than backward_passes_per_step times before call to step(). "
    "Increase backward_passes_per_step to accumulate gradients locally."
)
_ZERO_GRAD_TOO_EARLY = (
    "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
    "optimizer.synchronize(). This is prohibited as it can cause a race condition."
)


class _DistributedOptimizer:
    """Methods of the dynamic class `DistributedOptimizer` builds (see there).

    Like Horovod's, the class is created per wrapped optimizer type, so
    `isinstance(opt, torch.optim.SGD)` still holds; `_base` is that type.
    It also derives from this class, so `isinstance(opt, _DistributedOptimizer)`
    tells ours apart.
    """

    _base = torch.optim.Optimizer

    def __init__(
        self, params, named_parameters, config: PowerSGDConfig, comm, groups, log_every, model_names
    ):
        self._base.__init__(self, params)
        self.config = config
        self.compression, self.op, self.process_set = comm.compression, comm.op, comm.process_set
        # Accepted for Horovod compatibility: gradients already travel fused, in
        # buckets (reducer.py), so explicit groups change nothing that is sent.
        self.groups = groups
        self._comm = comm
        # Like Horovod: a rank outside the process set trains on its own gradients.
        self._active = comm.included()
        self._names: dict[torch.Tensor, str] = {p: name for name, p in named_parameters}
        # Horovod's name for the same mapping, which its tests and users' logging read.
        self._parameter_names = self._names
        # Every name the user gave (the model's, beyond the optimizer's): for messages.
        self._model_names = {**model_names, **self._names}
        # Parameters that get a gradient, in a fixed order (that of param_groups).
        self._params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        for p in self._params:
            if p.is_sparse or p.layout != torch.strided:
                raise ValueError(
                    f"parameter {self._names[p]!r} is sparse; PowerSGD compresses dense "
                    "gradients only (use a dense layer or plain hvd.DistributedOptimizer)"
                )
        # PowerSGD's state: compressor, reducer, tuner, statistics... (state.py). Its
        # construction compares the model and settings across ranks first; the
        # wrapped optimizer's settings are compared at the first step (Agreement),
        # after the user's hvd.broadcast_optimizer_state, which may make them equal.
        self.powersgd_state = PowerSGDState(
            self._params, self._names, config, comm, log_every=log_every, elastic=_elastic()
        )
        frozen = [p for g in self.param_groups for p in g["params"] if not p.requires_grad]
        # Refusing parameters unfrozen since, it resets the step (which did not start).
        reset = weakref.WeakMethod(self._reset_step)
        self._agreement = Agreement(
            self._active, comm.size, self._base.__qualname__, check_settings=not _elastic(),
            frozen=frozen, on_refused=lambda: reset()(),
        )  # fmt: skip
        # --- per step -------------------------------------------------------------------
        self._delay = {p: config.backward_passes_per_step for p in self._params}
        self._pending = False  # a backward pass was counted since the last synchronize()
        self._synchronized = False
        self._should_synchronize = True
        if self._active:
            # The hooks hold the optimizer weakly: once it is gone (say, replaced by
            # a new one on the same model) its hooks do nothing instead of counting
            # backward passes for a step that will never come.
            hook = _hook_of(weakref.ref(self))
            for older in {_NEWEST[p]() for p in self._params if p in _NEWEST} - {None}:
                older._hook = _superseded(weakref.ref(older), weakref.ref(self))
            for p in self._params:
                p.register_post_accumulate_grad_hook(hook)
                _NEWEST[p] = weakref.ref(self)

    # --- one step -------------------------------------------------------------------------
    def _hook(self, p: torch.Tensor) -> None:
        if self._delay[p] <= 0:
            raise AssertionError(_TOO_MANY_PASSES)
        self._delay[p] -= 1
        self._pending = True
        if self._delay[p] == 0:
            self._gradient_ready(p)

    def _gradient_ready(self, p: torch.Tensor) -> None:
        if self.powersgd_state.sparse.sparse or (p.grad is not None and p.grad.is_sparse):
            self.powersgd_state.sparse.ready(p)
        if not self.powersgd_state.reducer.in_step:
            _refuse_capture(p)
            self._begin_step()
        self.powersgd_state.reducer.ready(p)

    def _begin_step(self) -> None:
        # Before the step's first collective: agree on the state, if due.
        self._agreement.begin_step(self.powersgd_state, self.param_groups)
        # A synchronize() whose step was skipped (e.g. by GradScaler) is over.
        self._synchronized = False
        self.powersgd_state.begin_step()

    def synchronize(self) -> None:
        """Finish this step's communication; afterwards `p.grad` holds the aggregate.

        Parameters whose hook did not fire (unused this step, or gradients set
        by hand) count as ready now. With rounds=2 every bucket's P is projected
        once all are back, and every Q leaves in one all-reduce.
        """
        if not self._active:
            self._synchronized = True
            return
        state = self.powersgd_state
        if not state.reducer.in_step:
            self._begin_step()
        for p in [p for p in self._params if p not in state.reducer.done]:
            self._ready_without_hook(p)
        state.reducer.finish()
        state.step += 1
        state.guard.note_step(state.step)
        self._reset_step()
        self._synchronized = True
        if state.monitor is not None:  # its warning may raise (-W error) on every rank alike
            # This step's buckets compressed (reset() keeps them).
            state.monitor.end_step(state.step, state.reducer.compressing, self.compression_stats)
        state.compressor.graphs.end()  # the step's segments all ran (captured: complete)
        state.tuner.end_step(state)  # rank="auto": measure, try, settle (it may change ranks)
        if state.sparse.checks:  # after the first step, a dense model's step skips it
            state.sparse.settle()

    def _ready_without_hook(self, p: torch.Tensor) -> None:
        """A parameter whose hook did not fire this step (unused, or a gradient set by hand)."""
        self._delay[p] = 0
        if not p.requires_grad:
            # Frozen after construction (requires_grad_(False)): like Horovod, it
            # gets the average of what the ranks hold in p.grad, zero after
            # zero_grad(); its residual is dropped, or PowerSGD would go on
            # delivering it and move the layer.
            self.powersgd_state.compressor.reset_error([self._names[p]])
        self._gradient_ready(p)

    def step(self, closure=None):
        # Synchronized, and no backward pass since (its first hook, _begin_step, clears it).
        if self._should_synchronize and self._synchronized:
            _warn_synchronized_already()
        elif self._should_synchronize:
            self.synchronize()
        self._synchronized = False
        result = self._base.step(self, closure)
        if self.powersgd_state.guard.pending:
            self._check_drift()
        return result

    def _check_drift(self) -> None:
        """Repair parameters and settings that differ across ranks, warning on every rank.

        Runs right after the wrapped optimizer's step, so the parameters and
        their optimizer state are identical on every rank after it (guard.py),
        and the wrapped optimizer's settings are the first rank's
        (agreement.settings_agreed). Parameters put into param_groups by hand
        since construction are refused, on every rank alike.
        """
        # What else must agree rides in the same all-gather: parameters put into
        # param_groups by hand (refused on every rank alike) and the settings' digest.
        state, groups = self.powersgd_state, self.param_groups
        new = [p for g in groups for p in g["params"] if p not in self._names]
        mine = signature_digest(signature(state, groups, self._base.__qualname__))
        drifted = state.guard.check(self.state, [len(new), *mine])
        everyone = state.guard.extra
        if any(row[0] for row in everyone):
            members = hvd_comm.members(self.process_set)
            ranks = [members[r] for r, row in enumerate(everyone) if row[0]]
            refuse_new_parameters(
                describe_new(new, self._model_names) or ["none on this rank"],
                f"parameters put into param_groups since the optimizer was wrapped, on rank(s) "
                f"{ranks}",
            )
        if any(row[1:] != everyone[0][1:] for row in everyone):  # the rare path gathers all
            differed = settings_agreed(state, groups, self._base.__qualname__)
            if differed:  # the same text on every rank
                warnings.warn(differed, stacklevel=3)
        if drifted:
            # Every rank knows the same list (from one all-gather): all warn alike.
            warnings.warn(
                f"parameters differed across ranks at step {state.step} and were "
                f"reset to rank {hvd_comm.first_rank(self.process_set)}'s: {drifted[:5]}"
                f"{' ...' if len(drifted) > 5 else ''} "
                "(after a resume, hvd.broadcast_optimizer_state's initialising step with "
                "weight decay moves the ranks that had no optimizer state; later, ranks "
                "whose processors or thread counts round differently drift apart, since each "
                "rebuilds the compressed gradient itself; see drift_check_every)",
                stacklevel=3,
            )

    def _reset_step(self) -> None:
        """Forget everything about the step in progress (after it, or on load_state_dict)."""
        self.powersgd_state.reducer.reset()
        self._pending = False
        self._delay = dict.fromkeys(self._params, self.config.backward_passes_per_step)

    # --- Horovod's optimizer interface ----------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        """Refused once wrapped, naming the parameters: see agreement.refuse_new_parameters.

        Raises on the rank that calls it (the same code on every rank: on every
        rank), before any collective, and changes nothing: the optimizer trains
        on as before.
        """
        if "_agreement" not in self.__dict__:  # torch's __init__ adds the groups it is built with
            return self._base.add_param_group(self, param_group)
        params = param_group["params"]
        params = [params] if torch.is_tensor(params) else list(params)
        refuse_new_parameters(
            describe_new(params, self._model_names),
            "add_param_group() after the optimizer was wrapped, with parameters",
        )

    @contextmanager
    def skip_synchronize(self):
        """Make `step()` skip the communication `synchronize()` already did.

        The pattern for gradient clipping and AMP::

            scaler.scale(loss).backward()
            optimizer.synchronize()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with optimizer.skip_synchronize():
                scaler.step(optimizer)
            scaler.update()
        """
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def zero_grad(self, set_to_none: bool = True):
        if self._pending:
            raise AssertionError(_ZERO_GRAD_TOO_EARLY)
        return self._base.zero_grad(self, set_to_none=set_to_none)

    @property
    def backward_passes_per_step(self) -> int:
        return self.config.backward_passes_per_step

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Accumulate `passes` local backward passes per step from now on (as Horovod)."""
        self.config = dataclasses.replace(self.config, backward_passes_per_step=passes)
        for p in self._params:
            self._delay[p] = passes

    # --- statistics, state, agreement -------------------------------------------------------
    def compression_stats(self, per_layer: bool = False) -> dict:
        """Totals over all steps so far, for this rank; with `per_layer`, each layer's quality.

        Args:
            per_layer: add `layers` (one dict per compressed tensor) and
                `checked_step`. Reading them waits for the device once.

        Returns:
            dict with `steps`; `elements_uncompressed`, the gradient elements a
            plain all-reduce would have sent; `elements_sent`, the elements this
            rank handed to Horovod collectives (P, Q and uncompressed tensors);
            `bytes_sent`, the same in bytes at the dtype sent; and `ratio`,
            elements_uncompressed / elements_sent (0.0 before the first step).
            These are this rank's (equal on every rank in a plain data-parallel run).
            With rank="auto" also `plan`: per parameter `name`, `bucket`, `method`
            ("powersgd" or "plain"), `rank` (0: plain), `bucket_ms` (the bucket's
            measured local work at that rank) and `saved_ms` (the model's
            expected saving over sending the bucket plain); see docs/auto.md.

            With `per_layer` (and `layer_stats=True`), `layers` lists per
            compressed tensor: `name`, `shape`, `matrix` (n, m), `rank`,
            `elements_per_step` (P and Q elements it sends per step), and four
            moving averages over about the last 10 compressed steps:
            `relative_error` (‖M − P̂·Qᵀ‖ / ‖M‖ of the matrix compressed,
            gradient plus error feedback) and `error_ratio` (error buffer norm /
            gradient norm) of *this rank*, and `avg_relative_error` and
            `avg_error_ratio`, the same averaged over all ranks at step
            `checked_step`, the last multiple of 10 (identical on every rank:
            what the log line and the early warning use). None where there is no
            value yet. `error_norm` and `gradient_norm` are the whole model's
            (over the layers' moving averages, mean of the ranks at
            `checked_step`): what the early warning watches. The averages
            are not saved: `load_state_dict` (and taking another rank's state)
            starts them again, so they describe only steps of the state loaded.

        Example:
            >>> worst = max(opt.compression_stats(per_layer=True)["layers"],
            ...             key=lambda layer: layer["avg_relative_error"] or 0)
        """
        state = self.powersgd_state
        stats = state.totals()
        sent = stats["elements_sent"]
        stats["ratio"] = stats["elements_uncompressed"] / sent if sent else 0.0
        if self.config.auto:
            stats["plan"] = state.tuner.plan(state)
        if per_layer:
            monitor = state.monitor
            stats["layers"] = monitor.layers() if monitor is not None else []
            stats["checked_step"] = monitor.checked_step if monitor is not None else None
            norms = monitor.model_norms() if monitor is not None else (None, None)
            stats["error_norm"], stats["gradient_norm"] = norms
        return stats

    @property
    def compressor(self):
        """PowerSGD's compressor (compressor.PowerSGDCompressor): error buffers, memories."""
        return self.powersgd_state.compressor

    @property
    def powersgd_step(self) -> int:
        """Communication steps done so far (PowerSGD's step counter)."""
        return self.powersgd_state.step

    def state_dict(self):
        """The wrapped optimizer's state plus this rank's PowerSGD state.

        The PowerSGD part (key ``"powersgd"``) holds the error buffers, Q
        memory, RNG states and step counter. Error buffers differ per rank:
        save every rank's (see `save_checkpoint`), not only rank 0's.

        Rank-local, like any `state_dict()`: a rank may save it alone. Its
        first param group carries one more option, ``"powersgd_agree"``:
        `hvd.broadcast_optimizer_state` sets it on every rank, which makes
        the ranks agree on the PowerSGD state at the next step (so a rank 0
        that alone loaded a state mid-training, then that broadcast, works).
        """
        state = self._base.state_dict(self)
        if state["param_groups"]:
            state["param_groups"][0][SYNC_KEY] = True
        state[STATE_KEY] = self.powersgd_state.state_dict()
        return state

    def load_state_dict(self, state_dict):
        """Restore `state_dict()` output. Validates before changing anything.

        A checkpoint saved with a different number of workers restores the Q
        memory, RNG and step counter but resets the error buffers (with a
        warning): residuals belong to a worker's share of the data, and no
        sum-preserving way maps W old residuals onto W' new workers' futures
        better than starting from zero. Same number of workers: bit exact.
        Loading on one rank only (then `hvd.broadcast_optimizer_state`) is
        fine: the broadcast makes the other ranks agree.
        """
        state_dict, powersgd = dict(state_dict), self.powersgd_state
        ours = state_dict.pop(STATE_KEY, None)
        other_share = ours is not None and not powersgd.fits(ours)
        saved = ours
        if other_share:  # hierarchical: another share's matrices, or a flat state
            ours = None
        # The main file of `save_checkpoint` holds the shared state only: the
        # error buffers are in the rank files.
        shared_only = ours is not None and "error_buffers" not in ours["compressor"]
        if ours is not None:
            powersgd.check(ours)
            powersgd.sparse.take(ours.get("sparse", []))  # those leave PowerSGD
        self._reset_step()
        powersgd.sparse.forget_step()
        self._synchronized = False
        self._should_synchronize = True
        self._base.load_state_dict(self, state_dict)
        for group in self.param_groups:  # torch copied the saved groups' options
            group.pop(SYNC_KEY, None)
        self._agreement.request(loaded=True)
        powersgd.reset_monitor()  # the statistics of the steps before describe another state
        if ours is None:
            if other_share:  # hierarchical="auto" with rank="auto": its layout all the same
                powersgd.follow(saved)
            warnings.warn(
                "loading an optimizer state without PowerSGD state"
                + (" of this rank's share (hierarchical)" if other_share else "")
                + ": error buffers and Q memory start fresh",
                stacklevel=2,
            )
            return
        powersgd.load(ours)
        if shared_only:
            powersgd.compressor.reset_error()
            warnings.warn(
                "this optimizer state has PowerSGD's shared state (step counter, Q memory, "
                "RNG) but not this rank's error buffers, which start at zero; "
                "horovod_powersgd.load_checkpoint() on every rank resumes exactly",
                stacklevel=2,
            )
        self._agreement.world_size = self._comm.size
        if ours["world_size"] != self._comm.size:
            warnings.warn(
                f"checkpoint was saved with {ours['world_size']} workers, now "
                f"{self._comm.size}: PowerSGD error buffers reset to zero",
                stacklevel=2,
            )
            powersgd.compressor.reset_error()

    def broadcast_powersgd_state(self, root_rank: int | None = None) -> None:
        """Make the state that must agree across ranks equal to `root_rank`'s.

        `root_rank` is a global rank, as everywhere in Horovod (None: the
        first rank of the optimizer's process set).

        Q memory, RNG states and step counter must be identical on every rank
        (P = M·Q is summed across ranks). Error buffers are per worker and are
        not sent. A rank whose state differed from the root's (say, the root
        loaded a checkpoint) resets its error buffers, with a warning: they
        belonged to another trajectory. If the number of workers changed since
        the last sync, every rank resets them (each residual was a share of the
        old world's sum).

        Elastic Horovod's state sync calls this on every rank, and the first
        step after construction or `load_state_dict` does when the ranks'
        shared state differs. Call it yourself on every rank after a rank alone
        changed its state in the middle of training (say, rank 0 loaded a state
        after steps had run) without `hvd.broadcast_optimizer_state`.
        """
        if root_rank is None:
            root_rank = hvd_comm.first_rank(self.process_set)
        self._agreement.broadcast(self.powersgd_state, root_rank)


def _refuse_capture(p: torch.Tensor) -> None:
    """A step inside the user's own CUDA graph capture cannot work: Horovod's collectives
    go through its background thread, which a graph cannot hold. Raised at the step's
    first gradient, before any collective."""
    if p.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(_CAPTURED)


_CAPTURED = (
    "horovod_powersgd.DistributedOptimizer's step cannot run inside a CUDA graph capture "
    "(torch.cuda.graph, or make_graphed_callables around backward): Horovod's collectives "
    "go through a host thread the graph cannot hold. Capture the model's forward and "
    "backward without the optimizer's hooks, or pass cuda_graphs=True, which captures "
    "PowerSGD's own work between the collectives"
)


def _warn_synchronized_already() -> None:
    # Horovod would all-reduce the already averaged gradients again, which
    # leaves them as they are; a second PowerSGD round would compress them
    # again and change the update. So: no second round.
    warnings.warn(
        "optimizer.step() called without optimizer.skip_synchronize() after "
        "optimizer.synchronize(): the gradients are already aggregated and are "
        "used as they are. Wrap the step in `with optimizer.skip_synchronize():`.",
        stacklevel=3,
    )


def _superseded(old_ref, new_ref):
    """The `_hook` of an optimizer once a newer one wraps some of its parameters.

    Usually the older one is dropped as the newer one takes its place, and its
    hooks do nothing. Still alive (something references it: an LR scheduler built
    on it, a list), its hooks would go on counting backward passes and start its
    own step's collectives beside the newer one's: refused, naming it, before any
    collective, on every rank alike (each runs the same code). Should the newer
    one be dropped instead, the older one trains on. (Weak references: no cycle.)
    """

    def hook(p: torch.Tensor) -> None:
        old, new = old_ref(), new_ref()
        if new is None:
            del old._hook  # the class's again
            return old._hook(p)
        _refuse_superseded(old, new, p)

    return hook


def _refuse_superseded(old, new, p: torch.Tensor) -> None:
    raise RuntimeError(
        f"parameter {old._names[p]!r} is wrapped by two horovod_powersgd optimizers: a newer "
        f"one ({new._base.__name__}, over {len(new._params)} parameters) and this older "
        f"one ({old._base.__name__}, over {len(old._params)} parameters), which is still "
        "referenced somewhere (an LR scheduler or a list built on it?) and so still hooked "
        "into every backward pass. The older optimizer is the cause: drop every reference "
        "to it (build the LR scheduler again on the new optimizer) before training with "
        "the new one"
    )


def _hook_of(optimizer_ref):
    def hook(p):
        if (optimizer := optimizer_ref()) is not None:
            optimizer._hook(p)

    return hook


def _elastic() -> bool:
    return os.environ.get("HOROVOD_ELASTIC") == "1"


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters=None,
    compression=hvd_comm.Compression.none,
    backward_passes_per_step: int = 1,
    op=hvd_comm.Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups=None,
    sparse_as_dense: bool = False,
    process_set=hvd_comm.global_process_set,
    *,
    rank: int | str = 2,
    rounds: int = 2,
    start_iter: int = 0,
    min_compression_rate: float = 2.0,
    error_feedback: bool = True,
    warm_start: bool = True,
    seed: int = 0,
    comm_dtype: torch.dtype | None = None,
    drift_check_every: int = 100,
    layer_stats: bool = True,
    log_every: int = 0,
    max_rank: int = 16,
    auto_link: str | None = None,
    hierarchical: bool | str = False,
    cuda_graphs: bool = False,
):
    """Wrap a torch optimizer so that its gradients are averaged with PowerSGD.

    A drop-in for `hvd.DistributedOptimizer`: the same arguments in the same
    order, the same launch, the same `synchronize()` / `skip_synchronize()`.
    PowerSGD's own settings follow, keyword-only. Each gradient of shape
    (n, ...) is viewed as an n x m matrix M (conv weights as out x in·kh·kw)
    and, if it shrinks at least `min_compression_rate`-fold, sent as P (n x r)
    and Q (m x r) instead of n·m numbers; 1-D tensors and small matrices
    travel uncompressed in the same collective as P. Gradients travel in
    buckets of about 4 MB of parameters, in the order backward produces them;
    a bucket leaves from the hook of its last gradient while backward goes on
    (the module docstring lists one step). `step()` calls `synchronize()`
    first, as Horovod's does.

    Choosing settings (measurements: docs/results/):
      * rank: 1-4 for CNNs (rank 2 matches SGD on ResNet-18/CIFAR-10 in the
        paper), about 4 for an LSTM language model, 4-16 for a transformer.
      * rounds: 2 (default) is the paper's step. 1 sends one factor per step
        and nothing after backward, but half a power iteration per step tracks
        the gradient worse: it needs a higher rank or a smaller learning rate.
      * start_iter: plain all-reduce for this many steps; about the end of the
        learning-rate warm-up.
      * compression=hvd.Compression.fp16 (or comm_dtype=torch.float16) halves
        the bytes: P and Q are computed against orthonormal partners, so they
        have the gradient's scale and float16 keeps them as well as it keeps
        plain gradients. Orthogonalisation still runs in float32.
    Memory added per compressed n x m parameter: n·m (error buffer) plus
    about 3·r·(n+m) (P, Q, Q memory; rounds=1 also a P memory), in float32
    for 16-bit parameters.

    Args:
        optimizer: the torch optimizer to wrap (its param_groups are reused).
        named_parameters: (name, parameter) pairs, e.g. model.named_parameters();
            must name every parameter of the optimizer, uniquely.
        compression: a Horovod compressor. `hvd.Compression.fp16` sends
            everything in float16, warm-up steps included; any other is applied,
            as in Horovod, to the tensors that travel uncompressed.
        backward_passes_per_step: local backward passes (summed in p.grad) per step.
        op: hvd.Average or hvd.Sum (hvd.Adasum is not linear: ValueError).
        gradient_predivide_factor: with Average, divide by this before the sum
            and by size/factor after.
        num_groups: Horovod's deprecated name for `groups`.
        groups: accepted and validated as Horovod does; every round of a step
            already travels as one fused collective, so it changes nothing sent.
        sparse_as_dense: make sparse gradients (nn.Embedding(sparse=True)) dense,
            so they are compressed like any other, and, as Horovod does, hand the
            aggregate back sparse (`to_sparse()`) before the wrapped optimizer
            steps, so torch.optim.SparseAdam works. Without it they are
            all-gathered (indices and values) outside PowerSGD, as Horovod does.
            Which gradients are sparse is agreed by every rank (sparse.py).
        process_set: the Horovod process set to reduce over. A rank outside it
            trains on its own gradients, as with Horovod.
        rank: matrix approximation rank r (>= 1), capped at min(n, m) per tensor;
            or "auto": each bucket plain or at a rank up to `max_rank`, chosen
            from measurements of this job (tuner.py, docs/auto.md) and kept up
            to date; `compression_stats()["plan"]` shows the choice.
        rounds: all-reduce rounds per step: 2 = P, then Q; 1 = Q and P alternately.
        start_iter: steps of plain all-reduce before compression starts.
        min_compression_rate: compress an n x m gradient only if
            n·m >= min_compression_rate · r · (n + m).
        error_feedback: keep what compression dropped and add it back next step.
        warm_start: reuse last step's Q instead of a fresh random one.
        seed: seed of the random Q (must be, and is checked to be, equal on all ranks).
        comm_dtype: dtype compressed steps send P, Q and the uncompressed gradients
            in (None: the compute dtype for P/Q, the compression's for the rest).
        drift_check_every: every this many steps, compare a fingerprint of the
            parameters and their optimizer state across ranks (two passes over
            them and one small all-gather); where they differ, take the first
            rank's and warn on every rank (0: never). Ranks whose processors or
            thread counts round differently drift apart by rounding errors.
        layer_stats: keep per-layer statistics (`compression_stats(per_layer=True)`)
            and warn (`ErrorGrowthWarning`, once, on every rank alike) when the
            error buffers grow steadily relative to the gradients, the pattern
            measured before divergence. Costs a norm of each compressed gradient
            and error buffer per step and a small all-reduce every 10 steps;
            must be the same on every rank.
        log_every: every this many steps, rank 0 logs one line (logger
            ``horovod_powersgd``, level INFO): steps, compression ratio, bytes,
            and the layers with the largest relative error. 0 (default): off.
            May differ between ranks.
        max_rank: rank="auto" chooses among plain and ranks 1, 2, 4, ... up to this.
        auto_link: rank="auto" plans for this link instead of the measured one,
            e.g. "50mbit" or "1gbit,2ms" (an all-reduce's bandwidth, then its
            latency); also HOROVOD_POWERSGD_LINK. For tests, or to train with a
            slow link's decisions on a fast one.
        hierarchical: on nodes of several workers: sum each bucket exactly inside
            the node (reduce-scatter), let each worker compress its share of the
            node's average (error feedback on it, 1/workers-per-node of the
            work) and all-reduce P and Q with its peers on the other nodes, then
            all-gather the shares in the node (hierarchy.py, docs/hierarchical.md).
            True, False, or "auto" (on for several nodes of several workers
            each). Needs HOROVOD_DYNAMIC_PROCESS_SETS=1 (or
            hvd.init(process_sets="dynamic")); not with elastic Horovod or a
            process set; with rank="auto", True has its ranks planned for the
            hierarchical step, and "auto" is chosen or not from the
            measurements (the model's step of each); True on one node or one worker
            per node warns and runs flat; uneven workers per node raise.
        cuda_graphs: on CUDA, capture the compressor's local work between Horovod's
            calls as CUDA graphs once a step's layout has run eagerly, and replay them
            (graphs.py): a few launches a step instead of hundreds, the same results.
            Eager on the CPU; with rank="auto", only once its plan is settled (its
            measuring and trial steps run eagerly); hierarchical: a segment of each
            bucket's in turn, as its stages arrive.
            Off by default until a GPU run has shown it correct and faster (docs/gpu.md).

    Returns:
        An optimizer of a class derived from `type(optimizer)`.

    Raises:
        ValueError: a bad setting, unnamed/duplicate/sparse parameters, or
            parameters or PowerSGD settings that differ across ranks (raised on
            every rank). The wrapped optimizer's settings (lr, momentum, ...) may
            differ when it is built, as in Horovod, until the user's
            hvd.broadcast_optimizer_state; where they still differ at the first
            step or at a drift check, every rank takes the first rank's and
            warns, naming them. Later, `add_param_group` raises, and so does the
            next step where a parameter frozen when it was wrapped requires grad:
            build the optimizer with every parameter you will train, each
            requiring grad when you wrap it (freeze some after, if you like).

    Example:
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size(), momentum=0.9)
        >>> opt = horovod_powersgd.DistributedOptimizer(  # was: hvd.DistributedOptimizer(
        ...     opt, named_parameters=model.named_parameters(), rank=2)
        >>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        >>> hvd.broadcast_optimizer_state(opt, root_rank=0)
        >>> loss_fn(model(x), y).backward(); opt.step()
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer)!r}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("optimizer is already a horovod_powersgd.DistributedOptimizer")
    comm_dtype = _check_horovod_args(compression, op, comm_dtype)
    if num_groups != 0:
        warnings.warn(
            "Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
            DeprecationWarning,
            stacklevel=2,
        )
        groups = num_groups if groups is None else groups
    check_groups(groups)
    check_log_every(log_every)
    config = PowerSGDConfig(
        rank=rank, rounds=rounds, start_iter=start_iter,
        min_compression_rate=min_compression_rate, error_feedback=error_feedback,
        warm_start=warm_start, seed=seed, comm_dtype=comm_dtype,
        drift_check_every=drift_check_every, backward_passes_per_step=backward_passes_per_step,
        gradient_predivide_factor=gradient_predivide_factor, sparse_as_dense=sparse_as_dense,
        layer_stats=layer_stats, max_rank=max_rank, auto_link=auto_link,
        hierarchical=hierarchical, cuda_graphs=cuda_graphs,
    )  # fmt: skip
    if gradient_predivide_factor != 1.0 and op != hvd_comm.Average:
        raise ValueError("gradient_predivide_factor is only supported with op=hvd.Average")
    if not isinstance(process_set, hvd_comm.ProcessSet):
        raise ValueError(f"process_set must be a hvd.ProcessSet, got {process_set!r}")
    hierarchy_check(config.hierarchical, process_set, _elastic())
    given = None if named_parameters is None else list(named_parameters)
    named_parameters = check_named_parameters(optimizer, given)
    model_names = {p: name for name, p in given or ()}
    comm = hvd_comm.Comm(process_set, op, compression, gradient_predivide_factor)
    # A class per wrapped type, as Horovod does, so isinstance checks keep working.
    # __module__ matches Horovod's optimizer module so that
    # hvd.broadcast_optimizer_state initialises the wrapped optimizer's state
    # with the plain (non-communicating) step, exactly as for Horovod's own
    # DistributedOptimizer, instead of running a PowerSGD step on zero gradients.
    members = dict(_DistributedOptimizer.__dict__)
    members.pop("__dict__", None)
    members.pop("__weakref__", None)
    members["_base"] = optimizer.__class__
    members["__module__"] = hvd_comm.HOROVOD_OPTIMIZER_MODULE
    cls = type(optimizer.__class__.__name__, (optimizer.__class__, _DistributedOptimizer), members)
    return cls(
        optimizer.param_groups, named_parameters, config, comm, groups, log_every, model_names
    )


def _check_horovod_args(compression, op, comm_dtype):
    """Validate Horovod's arguments (before any collective); returns the comm_dtype to use."""
    if op == hvd_comm.Adasum:
        raise ValueError(
            "op=hvd.Adasum is not supported: Adasum is not linear, so P and Q cannot be "
            "summed; use hvd.Average or hvd.Sum"
        )
    if op not in (hvd_comm.Average, hvd_comm.Sum):
        raise ValueError(f"op must be hvd.Average or hvd.Sum, got {op!r}")
    if not (
        callable(getattr(compression, "compress", None))
        and callable(getattr(compression, "decompress", None))
    ):
        raise ValueError(
            "compression must be a Horovod compressor such as hvd.Compression.none or "
            f"hvd.Compression.fp16, got {compression!r}"
        )
    if not hvd_comm.is_fp16(compression):
        return comm_dtype
    if comm_dtype not in (None, torch.float16):
        raise ValueError(
            f"compression=hvd.Compression.fp16 sends everything in float16, which conflicts "
            f"with comm_dtype={comm_dtype}; pass one of the two"
        )
    # P, Q and everything else of a compressed step in float16 too.
    return torch.float16


hvd_comm.register_state_handler(_DistributedOptimizer, ElasticHandler)
