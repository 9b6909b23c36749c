"""DistributedOptimizer: PowerSGD through Horovod collectives.

The only module that talks to Horovod. It hooks every parameter's gradient,
feeds the local math of `compressor.PowerSGDCompressor`, and hands its
collectives to `schedule.Schedule`, which sends each bucket of gradients as
soon as backward has produced it: one fused (grouped) all-reduce per bucket
and round (rounds=2: P, then Q; rounds=1: one factor).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import os
import pickle
import time
import warnings
import weakref
from contextlib import contextmanager

import horovod.torch as hvd
import torch
from horovod.torch.compression import FP16Compressor
from horovod.torch.elastic import state as _elastic_state

from .config import PowerSGDConfig
from .guard import DriftGuard
from .monitor import LayerMonitor
from .schedule import Schedule

# Each optimizer gets its own collective names: a count per process set, since
# the ranks of a process set build its optimizers in the same order.
_instances: dict = collections.defaultdict(itertools.count)

_STATE_KEY = "powersgd"
# An option our state_dict() adds to its first param group. hvd.broadcast_optimizer_state
# broadcasts every option of the root's param groups (the learning rate, ...) and sets
# it on every rank, so after it every rank finds this key in its param groups and
# agrees on the shared PowerSGD state at the next step, also when only the root had
# loaded a state in the middle of training (the others could not know otherwise).
_SYNC_KEY = "powersgd_agree"
# Param-group entries that are not settings of the wrapped optimizer.
_NOT_SETTINGS = ("params", "param_names", _SYNC_KEY)
# The ctx of a gradient cast to comm_dtype for the wire (not the user's compression).
_CAST = object()

# Dtypes Horovod 0.28 can all-reduce (CPU and CUDA alike). bfloat16 is not
# among them: bfloat16 gradients travel as float32 copies, and comm_dtype
# bfloat16 is refused up front.
_REDUCIBLE = (torch.float16, torch.float32, torch.float64)
# Dtypes Horovod 0.28 can broadcast; others (bfloat16, bool) travel as their bytes.
_BROADCASTABLE = (*_REDUCIBLE, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


# hvd.synchronize() waits by spinning on sched_yield, which keeps a core busy
# for as long as the collective takes. Where ranks share cores with each other
# or with Horovod's background threads (the other ranks' backward pass, the
# negotiation that completes the collective), that core is taken from the very
# work being waited for. Our waits poll and sleep instead; the added latency is
# at most about one interval per round.
_POLL_INTERVAL_S = 100e-6


def _wait(handle, timeout: float | None = None, late=None):
    """hvd.synchronize(handle), without keeping a core busy while it is pending.

    With `timeout` (seconds), raise `late()` once it has been pending that long.
    """
    deadline = None if not timeout else time.monotonic() + timeout
    while not hvd.poll(handle):
        if deadline is not None and time.monotonic() > deadline:
            raise late()
        time.sleep(_POLL_INTERVAL_S)
    return hvd.synchronize(handle)


class _DistributedOptimizer:
    """Methods of the dynamic class `DistributedOptimizer` builds (see there).

    Like Horovod's, the class is created per wrapped optimizer type, so
    `isinstance(opt, torch.optim.SGD)` still holds; `_base` is that type.
    It also derives from this class, so `isinstance(opt, _DistributedOptimizer)`
    tells ours apart.
    """

    _base = torch.optim.Optimizer

    def __init__(
        self,
        params,
        named_parameters,
        config: PowerSGDConfig,
        compression,
        op,
        groups,
        process_set,
        log_every: int = 0,
    ):
        self._base.__init__(self, params)
        self.config = config
        self.compression = compression
        self.op = op
        # Accepted for Horovod compatibility: gradients already travel fused, in
        # buckets (schedule.py), so explicit groups change nothing that is sent.
        self.groups = groups
        self.process_set = process_set
        set_id = process_set.process_set_id
        self._name = f"powersgd.{set_id}.{next(_instances[set_id])}"
        # Like Horovod: a rank outside the process set trains on its own gradients.
        self._active = process_set.included()

        self._names: dict[torch.Tensor, str] = {p: name for name, p in named_parameters}
        # Parameters that get a gradient, in a fixed order (that of param_groups).
        self._params: list[torch.Tensor] = [
            p for group in self.param_groups for p in group["params"] if p.requires_grad
        ]
        for p in self._params:
            if p.is_sparse or p.layout != torch.strided:
                raise ValueError(
                    f"parameter {self._names[p]!r} is sparse; PowerSGD compresses dense "
                    "gradients only (use a dense layer or plain hvd.DistributedOptimizer)"
                )
        # Under elastic Horovod a worker that joins builds its optimizer while
        # the others wait in the state sync: the check runs there instead.
        if self._active and os.environ.get("HOROVOD_ELASTIC") != "1":
            self._check_same_model_on_every_rank()
        self._synced_world_size = process_set.size()
        # The first step after construction, and after every load_state_dict(),
        # makes the ranks agree on the shared PowerSGD state before its first
        # collective (see `_agree_on_shared_state`); `_loaded`: this rank loaded one.
        self._agree_pending = self._active
        self._loaded = False

        # The schedule reaches back through a weak proxy, like the hooks below:
        # a reference cycle would keep a replaced optimizer (and its hooks)
        # alive until the garbage collector happens to run.
        me = weakref.proxy(self)
        self._schedule = Schedule(
            self._params,
            self._names,
            config,
            allreduce_async=lambda tensors, name: me._allreduce_async(tensors, name),
            poll=hvd.poll,
            wait=_wait,
            to_wire=lambda grad, comm_dtype: me._to_wire(grad, comm_dtype),
            from_wire=lambda tensor, ctx: me._from_wire(tensor, ctx),
        )
        self.compressor = self._schedule.compressor
        self._guard = DriftGuard(
            [(self._names[p], p) for p in self._params],
            config.drift_check_every,
            allgather=lambda t, name: hvd.allgather(
                t, name=f"{me._name}.{name}", process_set=me.process_set
            ),
            broadcast=lambda tensors, name: me._broadcast_in_place(tensors, name),
        )

        # --- per step (internal) ---------------------------------------------------
        self._delay = {p: config.backward_passes_per_step for p in self._params}
        self._pending = False  # a backward pass was counted since the last synchronize()
        self._ready: set = set()  # parameters whose gradient is final for this step
        self._step_begun = False
        self._synchronized = False
        self._should_synchronize = True
        self.powersgd_step = 0  # communication steps done so far
        self._drift_check_due = False  # step() compares the parameters across ranks
        # The first step after the ranks agreed on their state checks too: a
        # resume can leave ranks with different weights (with weight decay,
        # hvd.broadcast_optimizer_state's initialising step on zero gradients
        # moves those of ranks that had no optimizer state).
        self._check_after_agreeing = False

        # --- statistics ------------------------------------------------------------------
        self._numel = sum(p.numel() for p in self._params)
        self._stats = {"steps": 0, "elements_uncompressed": 0, "elements_sent": 0, "bytes_sent": 0}
        # Per-layer statistics, log line and early warning (monitor.py).
        self._monitor = None
        if config.layer_stats and self._active:
            self._monitor = LayerMonitor(
                self.compressor,
                lambda tensor, name: hvd.allreduce(
                    tensor, op=hvd.Sum, name=f"{me._name}.{name}", process_set=me.process_set
                ),
                workers=process_set.size(),
                reporter=process_set.rank() == 0,
                log_every=log_every,
            )

        if not self._active:
            return
        # The hooks hold the optimizer weakly: once it is gone (say, replaced by
        # a new one on the same model) its hooks do nothing instead of counting
        # backward passes for a step that will never come.
        this = weakref.ref(self)

        def hook(p):
            optimizer = this()
            if optimizer is not None:
                optimizer._hook(p)

        for p in self._params:
            p.register_post_accumulate_grad_hook(hook)

    # --- construction-time checks ------------------------------------------------------
    def _check_same_model_on_every_rank(self, optimizer_settings: bool = True):
        """One small collective: every rank must have the same parameters and settings.

        Otherwise the fused collectives would mismatch and hang, and optimizer
        states of different layouts (amsgrad on one rank only) could not be
        compared or repaired. All ranks compare all signatures, so all of them
        raise the same error. `optimizer_settings`: compare the wrapped
        optimizer's type and param-group settings too (not in an elastic sync,
        where a joining worker's learning rate is the initial one until
        broadcast_optimizer_state brings the others').
        """
        compression = getattr(self.compression, "__qualname__", type(self.compression).__name__)
        signature = [(self._names[p], tuple(p.shape), str(p.dtype)) for p in self._params] + [
            ("config", repr(self.config), str(self.op), compression)
        ]
        if optimizer_settings:
            signature += _optimizer_settings(self._base, self.param_groups)
        blob = pickle.dumps(signature)
        digest = torch.frombuffer(bytearray(hashlib.sha256(blob).digest()), dtype=torch.uint8)
        digests = hvd.allgather(
            digest.view(1, -1), name=f"{self._name}.signature", process_set=self.process_set
        )
        if bool((digests == digests[0]).all()):
            return
        # Rare path: gather everything to say precisely what differs.
        blobs = _allgather_bytes(blob, f"{self._name}.signature.full", self.process_set)
        mine = signature
        for other_rank, other_blob in enumerate(blobs):
            other = pickle.loads(other_blob)
            if other != mine:
                raise ValueError(
                    "the model or PowerSGD settings differ across ranks: "
                    + _first_difference(mine, other, self.process_set.rank(), other_rank)
                )

    def _global_ranks(self) -> list[int]:
        """The global ranks of the process set's members, in set-rank order."""
        ranks = self.process_set.ranks
        return list(range(hvd.size())) if ranks is None else list(ranks)

    def _first_rank(self) -> int:
        """The global rank of the process set's first member (Horovod's root ranks are global)."""
        return first_rank(self.process_set)

    def _reset_monitor(self) -> None:
        if self._monitor is not None:
            self._monitor.reset()

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
        shared state differs (see `_agree_on_shared_state`). Call it yourself
        on every rank after a rank alone changed its state in the middle of
        training (say, rank 0 loaded a state after steps had run).
        """
        if root_rank is None:
            root_rank = self._first_rank()
        shared = self.compressor.shared_state()
        payload = {"compressor": shared, "step": self.powersgd_step, "stats": self._stats}
        payload = hvd.broadcast_object(
            payload, root_rank=root_rank, name=f"{self._name}.sync", process_set=self.process_set
        )
        root = payload["compressor"]
        changed = payload["step"] != self.powersgd_step or any(
            not torch.equal(theirs.to(mine.device), mine)
            for theirs, mine in zip(root["q_memory"].values(), shared["q_memory"].values())
        )
        self.compressor.load_shared_state(root)
        self.powersgd_step = payload["step"]
        self._stats = dict(payload["stats"])
        self._agree_pending = self._loaded = False
        self._check_after_agreeing = True
        # One small all-gather tells every rank which ranks took the root's
        # state and whether any rank saw the world change (a worker that just
        # joined did not), so that all decide and warn alike: a warning on some
        # ranks only would, under -W error, raise there and leave the others
        # waiting in the next collective.
        flags = hvd.allgather(
            torch.tensor(
                [[int(changed and hvd.rank() != root_rank),
                  int(self.process_set.size() != self._synced_world_size)]]
            ),
            name=f"{self._name}.sync.changed",
            process_set=self.process_set,
        ).tolist()  # fmt: skip
        self._synced_world_size = self.process_set.size()
        members = self._global_ranks()
        took_over = [members[r] for r, (took, _) in enumerate(flags) if took]
        if any(resized for _, resized in flags):
            self.compressor.reset_error()  # every residual was a share of the old world's sum
            self._reset_monitor()
        elif took_over:
            if hvd.rank() in took_over:
                self.compressor.reset_error()
                self._reset_monitor()
            warnings.warn(
                f"rank(s) {took_over} took the PowerSGD state of rank {root_rank} (step "
                f"{self.powersgd_step}): their error buffers start at zero",
                stacklevel=3,
            )

    def _agree_on_shared_state(self) -> None:
        """Make every rank hold the same shared PowerSGD state before a step's collectives.

        Runs at the first step after construction and after `load_state_dict`.
        One small all-gather compares a digest of the step counter, Q (and P)
        memory and RNG states. Equal everywhere (the usual case): nothing more.
        Otherwise (say rank 0 alone loaded a checkpoint, and no
        `hvd.broadcast_optimizer_state` followed, which SGD without momentum
        does not need), the state of the lowest rank that loaded one (else
        rank 0) goes to every rank, with a warning on every rank, instead of
        the ranks disagreeing on warm-up, phase or shapes in the next
        collective (a hang or a shape mismatch).
        """
        self._agree_pending = False
        self._check_after_agreeing = True  # every rank is here: a collective
        digest = _state_digest(self.powersgd_step, self.compressor.shared_state())
        mine = torch.tensor([[int(self._loaded), *digest]], dtype=torch.int64)
        everyone = hvd.allgather(
            mine, name=f"{self._name}.agree", process_set=self.process_set
        ).tolist()
        self._loaded = False
        if all(row[1:] == everyone[0][1:] for row in everyone):
            return
        root = next((r for r, row in enumerate(everyone) if row[0]), 0)
        self.broadcast_powersgd_state(self._global_ranks()[root])

    # --- hooks ---------------------------------------------------------------------------
    def _hook(self, p: torch.Tensor) -> None:
        if self._delay[p] <= 0:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before "
                "call to step(). Increase backward_passes_per_step to accumulate gradients "
                "locally."
            )
        self._delay[p] -= 1
        self._pending = True
        if self._delay[p] == 0:
            self._gradient_ready(p)

    def _gradient_ready(self, p: torch.Tensor) -> None:
        if p.grad is not None and p.grad.is_sparse:
            if not self.config.sparse_as_dense:
                raise ValueError(
                    f"parameter {self._names[p]!r} produced a sparse gradient; PowerSGD "
                    "compresses dense gradients only: pass sparse_as_dense=True, or use "
                    "nn.Embedding(sparse=False)"
                )
            p.grad = p.grad.to_dense()
        if not self._step_begun:
            self._begin_step()
        if self._schedule.compressing and self.compressor.is_compressed(self._names[p]):
            # Runs layer by layer while backward continues.
            self.compressor.compress(self._names[p], p.grad)
            if self._monitor is not None:
                self._monitor.compressed(self._names[p], p.grad)
        self._ready.add(p)
        self._schedule.ready(p)

    @property
    def _compressing(self) -> bool:
        return self.powersgd_step >= self.config.start_iter

    def _begin_step(self):
        self._step_begun = True
        if any(_SYNC_KEY in group for group in self.param_groups):
            # hvd.broadcast_optimizer_state ran (see _SYNC_KEY): every rank is here.
            for group in self.param_groups:
                group.pop(_SYNC_KEY, None)
            self._agree_pending = self._active
        if self._agree_pending:
            self._agree_on_shared_state()  # may change the step counter: first
        # A synchronize() whose step was skipped (e.g. by GradScaler) is over.
        self._synchronized = False
        # Elastic Horovod skips the state sync when workers only left, so the
        # world size is checked here too: residuals of another world size are stale.
        if self.process_set.size() != self._synced_world_size:
            self.compressor.reset_error()
            self._synced_world_size = self.process_set.size()
        self._schedule.begin(self._compressing)
        if self._compressing:
            self.compressor.begin_step(workers=self.process_set.size())

    def _scale(self):
        if self.op == hvd.Average:
            f = self.config.gradient_predivide_factor
            return {"prescale_factor": 1.0 / f, "postscale_factor": f}
        return {}

    def _allreduce_async(self, tensors: list[torch.Tensor], name: str):
        """One grouped all-reduce of `tensors`, counted in the statistics."""
        self._stats["elements_sent"] += sum(t.numel() for t in tensors)
        self._stats["bytes_sent"] += sum(t.numel() * t.element_size() for t in tensors)
        return hvd.grouped_allreduce_async_(
            tensors,
            name=f"{self._name}.{name}",
            op=self.op,
            process_set=self.process_set,
            **self._scale(),
        )

    def _to_wire(self, grad: torch.Tensor, comm_dtype: torch.dtype | None):
        """(tensor to all-reduce, compression ctx) for a gradient that travels uncompressed.

        Compressed steps send everything in `comm_dtype` where one is set;
        otherwise the user's Horovod `compression` applies, as in Horovod.
        """
        if comm_dtype is not None:
            return (grad if grad.dtype == comm_dtype else grad.to(comm_dtype)), _CAST
        tensor, ctx = self.compression.compress(grad)
        if tensor.is_floating_point() and tensor.dtype not in _REDUCIBLE:
            tensor = tensor.float()  # bfloat16: Horovod 0.28 cannot reduce it
        return tensor, ctx

    def _from_wire(self, tensor: torch.Tensor, ctx) -> torch.Tensor:
        """The aggregate of a `_to_wire` tensor (the caller copies it into p.grad)."""
        return tensor if ctx is _CAST else self.compression.decompress(tensor, ctx)

    # --- Horovod's optimizer interface ---------------------------------------------------
    def synchronize(self) -> None:
        """Finish this step's communication; afterwards `p.grad` holds the aggregate.

        Parameters whose hook did not fire (unused this step, or gradients set
        by hand) count as ready now. With rounds=2 the Q round of every bucket
        starts as soon as its P round is back (here, or already in a hook).
        """
        if not self._active:
            self._synchronized = True
            return
        if not self._step_begun:
            self._begin_step()
        for p in self._params:
            if p not in self._ready:
                self._delay[p] = 0
                if not p.requires_grad:
                    # Frozen after construction (requires_grad_(False)): like
                    # Horovod, it gets the average of what the ranks hold in
                    # p.grad, zero after zero_grad(); its residual is dropped,
                    # or PowerSGD would go on delivering it and move the layer.
                    self.compressor.reset_error([self._names[p]])
                self._gradient_ready(p)
        self._schedule.finish()
        self._stats["steps"] += 1
        self._stats["elements_uncompressed"] += self._numel
        self.powersgd_step += 1
        # The check follows the update this step's gradients make (in step()). One
        # that is due stays due until a step() runs: GradScaler skips steps on every
        # rank alike, and the check after a resume must not be lost with the first.
        self._drift_check_due = (
            self._drift_check_due
            or self._guard.due(self.powersgd_step)
            or (self._check_after_agreeing and self._guard.every > 0)
        )
        self._check_after_agreeing = False
        self._reset_step()
        self._synchronized = True
        if self._monitor is not None:  # last: its warning may raise (-W error) on every rank
            self._monitor.workers = self.process_set.size()
            self._monitor.end_step(
                self.powersgd_step, self._schedule.compressing, self.compression_stats
            )

    def _check_drift(self) -> None:
        """Every `drift_check_every` steps, and at the first step after the ranks agreed on
        their state (see `_agree_on_shared_state`): repair parameters that differ across ranks.

        Runs right after the wrapped optimizer's step, so the parameters and
        their optimizer state are identical on every rank after it. (If no
        step() follows, say GradScaler skipped it on every rank, the check
        waits for the next step() that runs.)
        """
        self._drift_check_due = False
        drifted = self._guard.check(self.state)
        if drifted:
            # Every rank knows the same list (from one all-gather): all warn alike.
            warnings.warn(
                f"parameters differed across ranks at step {self.powersgd_step} and were "
                f"reset to rank {self._first_rank()}'s: {drifted[:5]}"
                f"{' ...' if len(drifted) > 5 else ''} "
                "(after a resume, hvd.broadcast_optimizer_state's initialising step with "
                "weight decay moves the ranks that had no optimizer state; later, ranks "
                "whose processors or thread counts round differently drift apart, since each "
                "rebuilds the compressed gradient itself; see drift_check_every)",
                stacklevel=3,
            )

    def _broadcast_in_place(self, tensors, name: str) -> None:
        """Overwrite `tensors` with those of the process set's first rank."""
        root = self._first_rank()
        handles, copies = [], []
        for i, t in enumerate(tensors):
            wire = t
            if t.dtype not in _BROADCASTABLE:
                # bfloat16, bool: Horovod 0.28 cannot broadcast them, but their bytes.
                wire = t.detach().contiguous().reshape(-1).view(torch.uint8)
                if wire.data_ptr() != t.data_ptr():
                    copies.append((t, wire))
            handles.append(
                hvd.broadcast_async_(
                    wire, root_rank=root, name=f"{self._name}.{name}.{i}",
                    process_set=self.process_set,
                )
            )  # fmt: skip
        for handle in handles:
            _wait(handle)
        for t, wire in copies:  # a non-contiguous tensor travelled as a copy
            t.copy_(wire.view(t.dtype).view(t.shape))

    def _reset_step(self) -> None:
        """Forget everything about the step in progress (after it, or on load_state_dict)."""
        self._ready.clear()
        self._schedule.reset()
        self._step_begun = False
        self._pending = False
        for p in self._params:
            self._delay[p] = self.config.backward_passes_per_step

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

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized and not self._step_begun:
                # Horovod would all-reduce the already averaged gradients again,
                # which leaves them as they are; a second PowerSGD round would
                # compress them again and change the update. So: no second round.
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() after "
                    "optimizer.synchronize(): the gradients are already aggregated and are "
                    "used as they are. Wrap the step in `with optimizer.skip_synchronize():`.",
                    stacklevel=2,
                )
            else:
                self.synchronize()
        self._synchronized = False
        result = self._base.step(self, closure)
        if self._drift_check_due:
            self._check_drift()
        return result

    def zero_grad(self, set_to_none: bool = True):
        if self._pending:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                "cause a race condition."
            )
        return self._base.zero_grad(self, set_to_none=set_to_none)

    @property
    def backward_passes_per_step(self) -> int:
        return self.config.backward_passes_per_step

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Accumulate `passes` local backward passes per step from now on (as Horovod)."""
        self.config = dataclasses.replace(self.config, backward_passes_per_step=passes)
        for p in self._params:
            self._delay[p] = passes

    # --- statistics and checkpoints --------------------------------------------------------
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
        stats = dict(self._stats)
        sent = stats["elements_sent"]
        stats["ratio"] = stats["elements_uncompressed"] / sent if sent else 0.0
        if per_layer:
            monitor = self._monitor
            stats["layers"] = monitor.layers() if monitor is not None else []
            stats["checked_step"] = monitor.checked_step if monitor is not None else None
            norms = monitor.model_norms() if monitor is not None else (None, None)
            stats["error_norm"], stats["gradient_norm"] = norms
        return stats

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
            state["param_groups"][0][_SYNC_KEY] = True
        state[_STATE_KEY] = {
            "step": self.powersgd_step,
            "world_size": self.process_set.size(),
            "stats": dict(self._stats),
            "compressor": self.compressor.state_dict(),
        }
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
        state_dict = dict(state_dict)
        ours = state_dict.pop(_STATE_KEY, None)
        # The main file of `save_checkpoint` holds the shared state only: the
        # error buffers are in the rank files.
        shared_only = ours is not None and "error_buffers" not in ours["compressor"]
        if ours is not None:
            if shared_only:
                self.compressor.check_shared_state(ours["compressor"])
            else:
                self.compressor.check_state_dict(ours["compressor"])
        self._reset_step()
        self._synchronized = False
        self._should_synchronize = True
        self._base.load_state_dict(self, state_dict)
        for group in self.param_groups:  # torch copied the saved groups' options
            group.pop(_SYNC_KEY, None)
        self._agree_pending, self._loaded = self._active, True
        self._reset_monitor()  # the statistics of the steps before describe another state
        if ours is None:
            warnings.warn(
                "loading an optimizer state without PowerSGD state: error buffers and Q "
                "memory start fresh",
                stacklevel=2,
            )
            return
        if shared_only:
            self.compressor.load_shared_state(ours["compressor"])
            self.compressor.reset_error()
            warnings.warn(
                "this optimizer state has PowerSGD's shared state (step counter, Q memory, "
                "RNG) but not this rank's error buffers, which start at zero; "
                "horovod_powersgd.load_checkpoint() on every rank resumes exactly",
                stacklevel=2,
            )
        else:
            self.compressor.load_state_dict(ours["compressor"])
        self.powersgd_step = ours["step"]
        self._stats = dict(ours["stats"])
        self._synced_world_size = self.process_set.size()
        if ours["world_size"] != self._synced_world_size:
            warnings.warn(
                f"checkpoint was saved with {ours['world_size']} workers, now "
                f"{self._synced_world_size}: PowerSGD error buffers reset to zero",
                stacklevel=2,
            )
            self.compressor.reset_error()


class _PowerSGDStateHandler(_elastic_state.OptimizerStateHandler):
    """`hvd.elastic.TorchState` handler for our optimizers.

    On every sync (start, and after each change of workers) it checks that all
    ranks hold the same model, brings rank 0's shared PowerSGD state to every
    rank (`broadcast_powersgd_state`), then does what the stock optimizer
    handler does: `hvd.broadcast_optimizer_state`.
    """

    def sync(self):
        self.value._check_same_model_on_every_rank(optimizer_settings=False)
        self.value.broadcast_powersgd_state(root_rank=0)
        super().sync()


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters=None,
    compression=hvd.Compression.none,
    backward_passes_per_step: int = 1,
    op=hvd.Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups=None,
    sparse_as_dense: bool = False,
    process_set=hvd.global_process_set,
    *,
    rank: int = 2,
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
):
    """Wrap a torch optimizer so that its gradients are averaged with PowerSGD.

    A drop-in for `hvd.DistributedOptimizer`: the same arguments in the same
    order, the same launch, the same `synchronize()` / `skip_synchronize()`.
    PowerSGD's own settings follow, keyword-only. Each gradient of shape
    (n, ...) is viewed as an n x m matrix M (conv weights as out x in·kh·kw)
    and, if it shrinks at least `min_compression_rate`-fold, sent as P (n x r)
    and Q (m x r) instead of n·m numbers; 1-D tensors and small matrices
    travel uncompressed in the same collective as P.

    Gradients travel in buckets of about 4 MB of parameters, in the order the
    backward pass produces them; a bucket leaves from the hook of its last
    gradient while backward goes on, its uncompressed gradients with it.

    One step with rounds=2 (the paper's; W workers, e: this worker's error buffer):
      1. M = grad + e; P = M·Q̂ (Q̂: last step's Q, orthonormalised) -- gradient hook
      2. all-reduce the bucket's P and uncompressed gradients      -- from the hook
      3. once back: P̂ = orth(P); Q_w = Mᵀ·P̂; all-reduce the Q      -- hook or synchronize()
      4. e = M − P̂·Q_wᵀ (while Q is in flight); grad = P̂·Q_avgᵀ   -- synchronize()
    One step with rounds=1 (alternating: one round, half the bytes):
      1. M = grad + e; even steps Q_w = Mᵀ·P̂ (P̂: last P, orthonormalised),
         odd steps P_w = M·Q̂; e = M minus this worker's approximation -- gradient hook
      2. all-reduce the bucket's factors and uncompressed gradients  -- from the hook
      3. grad = P̂·Q_avgᵀ or P_avg·Q̂ᵀ                                 -- synchronize()
    `step()` calls `synchronize()` first, as Horovod's does.

    Choosing settings:
      * rank: 1-4 for CNNs (rank 2 matches SGD on ResNet-18/CIFAR-10 in the
        paper), 4 for the LSTM language model (measured here: within 0.2 % of
        plain Horovod's perplexity); 4-16 for the AdamW transformer example
        (after 8 epochs, means of 2 seeds: 4 level with plain, -1.2 %; 16 ahead, -6.8 %).
      * rounds: 2 (default) is the paper's step. 1 sends one factor per step
        and nothing after backward, but half a power iteration per step tracks
        the gradient worse: it needs a higher rank or a smaller learning rate
        (it diverged at SGD lr 0.1, momentum 0.9, rank 2 on Fashion-MNIST,
        where rounds=2 trains; docs/results/rounds.md).
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
            so they are compressed like any other; without it they raise.
        process_set: the Horovod process set to reduce over. A rank outside it
            trains on its own gradients, as with Horovod.
        rank: matrix approximation rank r (>= 1), capped at min(n, m) per tensor.
        rounds: all-reduce rounds per step: 2 = P, then Q; 1 = Q and P alternately.
        start_iter: steps of plain all-reduce before compression starts.
        min_compression_rate: compress an n x m gradient only if
            n·m >= min_compression_rate · r · (n + m).
        error_feedback: keep what compression dropped and add it back next step.
        warm_start: reuse last step's Q instead of a fresh random one.
        seed: seed of the random Q (must be, and is checked to be, equal on all ranks).
        comm_dtype: dtype compressed steps send P, Q and the uncompressed gradients
            in (None: the compute dtype for P/Q, the compression's for the rest).
        drift_check_every: every this many steps, compare a checksum of the
            parameters and their optimizer state across ranks (one pass over
            them and one small all-gather); where they differ, take rank 0's
            and warn on every rank (0: never). Ranks whose processors or
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

    Returns:
        An optimizer of a class derived from `type(optimizer)`.

    Raises:
        ValueError: a bad setting, unnamed/duplicate/sparse parameters, or
            parameters or settings that differ across ranks (raised on every rank).

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
    if op == hvd.Adasum:
        raise ValueError(
            "op=hvd.Adasum is not supported: Adasum is not linear, so P and Q cannot be "
            "summed; use hvd.Average or hvd.Sum"
        )
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError(f"op must be hvd.Average or hvd.Sum, got {op!r}")
    comm_dtype = _check_compression(compression, comm_dtype)
    if num_groups != 0:
        warnings.warn(
            "Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
            DeprecationWarning,
            stacklevel=2,
        )
        if groups is None:
            groups = num_groups
    _check_groups(groups)
    config = PowerSGDConfig(
        rank=rank,
        rounds=rounds,
        start_iter=start_iter,
        min_compression_rate=min_compression_rate,
        error_feedback=error_feedback,
        warm_start=warm_start,
        seed=seed,
        comm_dtype=comm_dtype,
        drift_check_every=drift_check_every,
        backward_passes_per_step=backward_passes_per_step,
        gradient_predivide_factor=gradient_predivide_factor,
        sparse_as_dense=sparse_as_dense,
        layer_stats=layer_stats,
    )
    if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 0:
        raise ValueError(f"log_every must be an integer >= 0, got {log_every!r}")
    if comm_dtype is not None and comm_dtype not in _REDUCIBLE:
        raise ValueError(
            f"comm_dtype={comm_dtype} cannot be sent: Horovod all-reduces only "
            f"{', '.join(str(d) for d in _REDUCIBLE)}; use torch.float16 to halve P/Q bytes"
        )
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError("gradient_predivide_factor is only supported with op=hvd.Average")
    if not isinstance(process_set, hvd.ProcessSet):
        raise ValueError(f"process_set must be a hvd.ProcessSet, got {process_set!r}")
    named_parameters = _check_named_parameters(optimizer, named_parameters)

    # A class per wrapped type, as Horovod does, so isinstance checks keep working.
    # __module__ matches Horovod's optimizer module so that
    # hvd.broadcast_optimizer_state initialises the wrapped optimizer's state
    # with the plain (non-communicating) step, exactly as for Horovod's own
    # DistributedOptimizer, instead of running a PowerSGD step on zero gradients.
    members = dict(_DistributedOptimizer.__dict__)
    members.pop("__dict__", None)
    members.pop("__weakref__", None)
    members["_base"] = optimizer.__class__
    members["__module__"] = hvd.DistributedOptimizer.__module__
    cls = type(optimizer.__class__.__name__, (optimizer.__class__, _DistributedOptimizer), members)
    return cls(
        optimizer.param_groups,
        named_parameters,
        config,
        compression,
        op,
        groups,
        process_set,
        log_every=log_every,
    )


# hvd.elastic.TorchState picks the first handler whose type matches: ours first.
_elastic_state.set_handler_registry(
    [(_DistributedOptimizer, _PowerSGDStateHandler), *_elastic_state.get_handler_registry()]
)


def _check_compression(compression, comm_dtype):
    """Validate Horovod's `compression` against `comm_dtype`; returns the comm_dtype to use."""
    if not (
        callable(getattr(compression, "compress", None))
        and callable(getattr(compression, "decompress", None))
    ):
        raise ValueError(
            "compression must be a Horovod compressor such as hvd.Compression.none or "
            f"hvd.Compression.fp16, got {compression!r}"
        )
    is_fp16 = (
        isinstance(compression, type) and issubclass(compression, FP16Compressor)
    ) or isinstance(compression, FP16Compressor)
    if not is_fp16:
        return comm_dtype
    if comm_dtype not in (None, torch.float16):
        raise ValueError(
            f"compression=hvd.Compression.fp16 sends everything in float16, which conflicts "
            f"with comm_dtype={comm_dtype}; pass one of the two"
        )
    # P, Q and everything else of a compressed step in float16 too.
    return torch.float16


def _check_groups(groups) -> None:
    """Horovod's validation of `groups`: None, an integer > 0, or lists of tensors."""
    if groups is None:
        return
    if isinstance(groups, list):
        seen = set()
        for group in groups:
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor.")
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))
        return
    if isinstance(groups, bool) or not isinstance(groups, int) or groups <= 0:
        raise ValueError(
            "groups should be a non-negative integer or a list of list of torch.Tensor."
        )


def _check_named_parameters(optimizer, named_parameters):
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        # Like Horovod: positional names, identical on ranks that build the same optimizer.
        return [
            (f"group{i}.param{j}", p)
            for i, group in enumerate(optimizer.param_groups)
            for j, p in enumerate(group["params"])
        ]
    named_parameters = list(named_parameters)
    if any(not (isinstance(x, tuple) and len(x) == 2) for x in named_parameters):
        raise ValueError(
            "named_parameters should be a sequence of (name, parameter) tuples, usually "
            "produced by model.named_parameters()"
        )
    seen, dups = set(), []
    for name, _ in named_parameters:
        if name in seen:
            dups.append(name)
        seen.add(name)
    if dups:
        raise ValueError(f"parameter names in named_parameters must be unique; duplicates: {dups}")
    named_ids = {id(p) for _, p in named_parameters}
    unnamed = [i for i, p in enumerate(params) if id(p) not in named_ids]
    if unnamed:
        shapes = [tuple(params[i].shape) for i in unnamed[:5]]
        raise ValueError(
            f"{len(unnamed)} parameter(s) of the optimizer are missing from named_parameters "
            f"(shapes {shapes}); pass model.named_parameters() of the model being optimized"
        )
    param_ids = {id(p) for p in params}
    return [(name, p) for name, p in named_parameters if id(p) in param_ids]


def _state_digest(step: int, shared: dict) -> list[int]:
    """SHA-256 of the step counter and the shared PowerSGD state, as 4 int64 numbers."""
    h = hashlib.sha256(str(step).encode())
    for key in sorted(shared):
        value = shared[key]
        h.update(key.encode())
        if isinstance(value, dict):
            for name in sorted(value):
                h.update(name.encode())
                h.update(_raw_bytes(value[name]))
        elif isinstance(value, list):
            for tensor in value:
                h.update(_raw_bytes(tensor))
        else:
            h.update(repr(value).encode())
    return [int.from_bytes(h.digest()[i : i + 8], "little", signed=True) for i in (0, 8, 16, 24)]


def _raw_bytes(tensor: torch.Tensor):
    """The bytes of `tensor`'s elements, in order, as a numpy array (any dtype, any strides).

    Flattened first: a view with a size-1 dimension (a rank-1 Q memory, m x 1) is
    "contiguous" with a last stride > 1, which a byte view refuses.
    """
    return tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy()


def _allgather_bytes(blob: bytes, name: str, process_set) -> list[bytes]:
    data = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    sizes = hvd.allgather(
        torch.tensor([data.numel()]), name=f"{name}.sizes", process_set=process_set
    )
    gathered = hvd.allgather(data, name=f"{name}.data", process_set=process_set)
    out, offset = [], 0
    for size in sizes.tolist():
        out.append(gathered[offset : offset + size].numpy().tobytes())
        offset += size
    return out


def _settable(value):
    """`value` if it is plain data (compared by value across ranks), else its type's name.

    An object's repr may hold its address, which differs on every rank.
    """
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_settable(v) for v in value)
    if isinstance(value, torch.Tensor) and value.numel() <= 16:
        return repr(value.detach().cpu())
    return type(value).__qualname__


def _optimizer_settings(base: type, param_groups) -> list[tuple]:
    """The wrapped optimizer's type and each param group's settings, for the signature."""
    rows = [("optimizer", base.__qualname__)]
    for index, group in enumerate(param_groups):
        for key in sorted(k for k in group if k not in _NOT_SETTINGS):
            rows.append(("setting", index, key, _settable(group[key])))
    return rows


def _first_difference(mine, other, my_rank, other_rank) -> str:
    kinds = [[row for row in rows if row[0] == "optimizer"] for rows in (mine, other)]
    if kinds[0] != kinds[1]:
        return (
            f"the wrapped optimizer is {kinds[0][0][1] if kinds[0] else '?'} on rank {my_rank} "
            f"and {kinds[1][0][1] if kinds[1] else '?'} on rank {other_rank}"
        )
    mine_settings = {row[1:3]: row for row in mine if row[0] == "setting"}
    other_settings = {row[1:3]: row for row in other if row[0] == "setting"}
    for where in sorted(mine_settings.keys() | other_settings.keys()):
        a, b = mine_settings.get(where), other_settings.get(where)
        if a != b:
            index, key = where
            show = [("unset" if row is None else repr(row[3])) for row in (a, b)]
            return (
                f"optimizer setting {key!r} of param group {index} is {show[0]} on rank "
                f"{my_rank} and {show[1]} on rank {other_rank}; build the same optimizer on "
                "every rank"
            )
    mine = [row for row in mine if row[0] != "setting"]
    other = [row for row in other if row[0] != "setting"]
    if len(mine) != len(other):

        def count(rows):
            return sum(row[0] not in ("config", "optimizer") for row in rows)

        return (
            f"rank {my_rank} has {count(mine)} parameters with gradients, "
            f"rank {other_rank} has {count(other)}"
        )
    for a, b in zip(mine, other):
        if a != b:
            if a[0] in ("config", "optimizer"):
                return f"settings on rank {my_rank}: {a[1:]}; on rank {other_rank}: {b[1:]}"
            return (
                f"parameter {a[0]!r} {a[1:]} on rank {my_rank}, "
                f"{b[0]!r} {b[1:]} on rank {other_rank}"
            )
    return "unknown difference"


# --- collectives for other modules (only this module talks to Horovod) -------------------
def first_rank(process_set) -> int:
    """The global rank of `process_set`'s first member (Horovod's root ranks are global)."""
    return 0 if process_set.ranks is None else process_set.ranks[0]


class Collective:
    """Collectives of a call that every rank of `process_set` must make, with a deadline.

    A Horovod collective waits for ever for a rank that never joins it (say, a
    function called under `if hvd.rank() == 0:`); these raise `TimeoutError`,
    naming `what`, after `timeout` seconds instead (None or 0: wait for ever).
    """

    def __init__(self, what: str, process_set, timeout: float | None, hint: str = ""):
        self.what, self.process_set, self.timeout, self.hint = what, process_set, timeout, hint

    def _late(self):
        members = self.process_set.ranks or list(range(hvd.size()))
        return TimeoutError(
            f"{self.what} waited {self.timeout:g} s on rank {hvd.rank()} for the other ranks "
            f"of its process set {members}: it is collective, so every one of them must call "
            f"it{self.hint}"
        )

    def _wait(self, handle):
        return _wait(handle, self.timeout, self._late)

    def allgather_object(self, obj, name: str) -> list:
        """`obj` of every rank of the process set, in rank order."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = self._wait(
            hvd.allgather_async(
                torch.tensor([data.numel()]), name=f"{name}.sizes", process_set=self.process_set
            )
        )
        gathered = self._wait(
            hvd.allgather_async(data, name=f"{name}.data", process_set=self.process_set)
        )
        out, offset = [], 0
        for size in sizes.tolist():
            out.append(pickle.loads(gathered[offset : offset + size].numpy().tobytes()))
            offset += size
        return out

    def broadcast_object(self, obj, name: str):
        """The process set's first rank's `obj`, on every rank of the set."""
        root = first_rank(self.process_set)
        data = pickle.dumps(obj) if hvd.rank() == root else b""
        size = torch.tensor([len(data)])
        self._wait(
            hvd.broadcast_async_(size, root, name=f"{name}.size", process_set=self.process_set)
        )
        buffer = torch.zeros(int(size), dtype=torch.uint8)
        if hvd.rank() == root:
            buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self._wait(
            hvd.broadcast_async_(buffer, root, name=f"{name}.data", process_set=self.process_set)
        )
        return pickle.loads(buffer.numpy().tobytes())
