"""DistributedOptimizer: PowerSGD through Horovod collectives.

The only module that talks to Horovod. It hooks every parameter's gradient,
feeds the local math of `compressor.PowerSGDCompressor`, and runs the two
communication rounds of a step, each as one fused (grouped) all-reduce.
"""

from __future__ import annotations

import collections
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
from horovod.torch.elastic import state as _elastic_state

from .compressor import PowerSGDCompressor
from .config import PowerSGDConfig

# Each optimizer gets its own collective names: a count per process set, since
# the ranks of a process set build its optimizers in the same order.
_instances: dict = collections.defaultdict(itertools.count)

_STATE_KEY = "powersgd"

# Dtypes Horovod 0.28 can all-reduce (CPU and CUDA alike). bfloat16 is not
# among them: bfloat16 gradients travel as float32 copies, and comm_dtype
# bfloat16 is refused up front.
_REDUCIBLE = (torch.float16, torch.float32, torch.float64)


# hvd.synchronize() waits by spinning on sched_yield, which keeps a core busy
# for as long as the collective takes. Where ranks share cores with each other
# or with Horovod's background threads (the other ranks' backward pass, the
# negotiation that completes the collective), that core is taken from the very
# work being waited for. Our waits poll and sleep instead; the added latency is
# at most about one interval per round.
_POLL_INTERVAL_S = 100e-6


def _wait(handle):
    """hvd.synchronize(handle), without keeping a core busy while it is pending."""
    while not hvd.poll(handle):
        time.sleep(_POLL_INTERVAL_S)
    return hvd.synchronize(handle)


def _wire_dtype(dtype: torch.dtype, comm_dtype: torch.dtype | None = None) -> torch.dtype:
    """The dtype a gradient of `dtype` travels in (`comm_dtype` where one is set)."""
    if comm_dtype is not None:
        return comm_dtype
    return dtype if dtype in _REDUCIBLE else torch.float32


class _DistributedOptimizer:
    """Methods of the dynamic class `DistributedOptimizer` builds (see there).

    Like Horovod's, the class is created per wrapped optimizer type, so
    `isinstance(opt, torch.optim.SGD)` still holds; `_base` is that type.
    It also derives from this class, so `isinstance(opt, _DistributedOptimizer)`
    tells ours apart.
    """

    _base = torch.optim.Optimizer

    def __init__(self, params, named_parameters, config: PowerSGDConfig, op, process_set):
        self._base.__init__(self, params)
        self.config = config
        self.op = op
        self.process_set = process_set
        set_id = process_set.process_set_id
        self._name = f"powersgd.{set_id}.{next(_instances[set_id])}"

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
        if os.environ.get("HOROVOD_ELASTIC") != "1":
            self._check_same_model_on_every_rank()
        self._synced_world_size = process_set.size()

        self.compressor = PowerSGDCompressor([(self._names[p], p) for p in self._params], config)
        self._uncompressed = [
            p for p in self._params if not self.compressor.is_compressed(self._names[p])
        ]
        self._compressed = [
            p for p in self._params if self.compressor.is_compressed(self._names[p])
        ]

        # --- per step (internal) ---------------------------------------------------
        self._delay = {p: config.backward_passes_per_step for p in self._params}
        self._ready: set = set()  # parameters whose gradient is final for this step
        self._round1 = None  # handle of the in-flight P (+ uncompressed) collective
        self._casts = []  # (gradient, copy in the dtype it travels in) where the two differ
        self._step_begun = False
        self._synchronized = False
        self._should_synchronize = True
        self.powersgd_step = 0  # communication steps done so far

        # --- statistics ------------------------------------------------------------------
        numel = sum(p.numel() for p in self._params)
        raw_bytes = sum(p.numel() * _wire_size(p.dtype) for p in self._params)
        p_elems, q_elems = self.compressor.elements_per_step()
        plain_elems = sum(p.numel() for p in self._uncompressed)
        plain_bytes = sum(
            p.numel() * _wire_size(p.dtype, config.comm_dtype) for p in self._uncompressed
        )
        self._per_step = {
            "warmup": (numel, numel, raw_bytes),
            "compressed": (
                numel,
                p_elems + q_elems + plain_elems,
                self.compressor.bytes_per_step() + plain_bytes,
            ),
        }
        self._stats = {"steps": 0, "elements_uncompressed": 0, "elements_sent": 0, "bytes_sent": 0}

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
    def _check_same_model_on_every_rank(self):
        """One small collective: every rank must have the same parameters and settings.

        Otherwise the fused collectives would mismatch and hang. All ranks
        compare all signatures, so all of them raise the same error.
        """
        signature = [(self._names[p], tuple(p.shape), str(p.dtype)) for p in self._params] + [
            ("config", repr(self.config), str(self.op))
        ]
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

    def broadcast_powersgd_state(self, root_rank: int = 0) -> None:
        """Make the state that must agree across ranks equal to `root_rank`'s.

        Q memory, RNG states and step counter must be identical on every rank
        (P = M·Q is summed across ranks). Error buffers are per worker and are
        not sent; if the number of workers changed since the last sync they
        are reset to zero (each residual was a share of the old world's sum).
        Called by elastic Horovod's state sync (see `_PowerSGDStateHandler`);
        call it yourself after changing the workers in any other way.
        """
        shared = self.compressor.state_dict()
        payload = {
            "q_memory": shared["q_memory"],
            "rng_states": shared["rng_states"],
            "step": self.powersgd_step,
        }
        payload = hvd.broadcast_object(
            payload, root_rank=root_rank, name=f"{self._name}.sync", process_set=self.process_set
        )
        self.compressor.load_shared_state(payload["q_memory"], payload["rng_states"])
        self.powersgd_step = payload["step"]
        if self.process_set.size() != self._synced_world_size:
            self.compressor.reset_error()
            self._synced_world_size = self.process_set.size()

    # --- hooks ---------------------------------------------------------------------------
    def _hook(self, p: torch.Tensor) -> None:
        if self._delay[p] <= 0:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before "
                "call to step(). Increase backward_passes_per_step to accumulate gradients "
                "locally."
            )
        self._delay[p] -= 1
        if self._delay[p] == 0:
            self._gradient_ready(p)

    def _gradient_ready(self, p: torch.Tensor) -> None:
        if p.grad is not None and p.grad.is_sparse:
            raise ValueError(
                f"parameter {self._names[p]!r} produced a sparse gradient; PowerSGD compresses "
                "dense gradients only (e.g. nn.Embedding(sparse=False))"
            )
        if not self._step_begun:
            self._begin_step()
        if self._compressing and self.compressor.is_compressed(self._names[p]):
            # Steps 1-2 run here, layer by layer, while backward continues.
            self.compressor.compress(self._names[p], p.grad)
        self._ready.add(p)
        if len(self._ready) == len(self._params):
            self._launch_round1()

    @property
    def _compressing(self) -> bool:
        return self.powersgd_step >= self.config.start_iter

    def _begin_step(self):
        self._step_begun = True
        # A synchronize() whose step was skipped (e.g. by GradScaler) is over.
        self._synchronized = False
        if self._compressing:
            self.compressor.begin_step()

    def _scale(self):
        if self.op == hvd.Average:
            f = self.config.gradient_predivide_factor
            return {"prescale_factor": 1.0 / f, "postscale_factor": f}
        return {}

    def _launch_round1(self):
        """Step 3: one grouped all-reduce of all P and every uncompressed gradient."""
        for p in self._params:
            if p.grad is None:
                # Unused on this rank; another rank may have a gradient, so send zeros.
                p.grad = torch.zeros_like(p)
        # Warm-up steps are plain Horovod; compressed steps send everything in
        # comm_dtype, the uncompressed gradients included.
        plain = self._uncompressed if self._compressing else self._params
        comm_dtype = self.config.comm_dtype if self._compressing else None
        wire = [(p.grad, _wire_dtype(p.grad.dtype, comm_dtype)) for p in plain]
        self._casts = [(grad, grad.to(dtype)) for grad, dtype in wire if grad.dtype != dtype]
        cast = {id(grad): copy for grad, copy in self._casts}
        plain_tensors = [cast.get(id(p.grad), p.grad) for p in plain]
        p_tensors = self.compressor.p_buffers() if self._compressing else []
        tensors = p_tensors + plain_tensors
        self._round1 = hvd.grouped_allreduce_async_(
            tensors,
            name=f"{self._name}.round1",
            op=self.op,
            process_set=self.process_set,
            **self._scale(),
        )
        self._round1_count = len(p_tensors)

    # --- Horovod's optimizer interface ---------------------------------------------------
    def synchronize(self) -> None:
        """Finish this step's communication; afterwards `p.grad` holds the aggregate.

        Parameters whose hook did not fire (unused this step, or gradients set
        by hand) count as ready now. Steps 4-6 run here: they need the summed P.
        """
        if not self._step_begun:
            self._begin_step()
        for p in self._params:
            if p not in self._ready:
                self._delay[p] = 0
                self._gradient_ready(p)
        # The last ready gradient launched round 1, unless there is no gradient at all.
        outputs = _wait(self._round1) if self._round1 is not None else []
        self._round1 = None
        for grad, copy in self._casts:
            grad.copy_(copy)
        self._casts = []
        kind = "warmup"
        if self._compressing and self._compressed:
            kind = "compressed"
            p_sums = list(outputs[: self._round1_count])
            q_buffers = self.compressor.project(p_sums)  # steps 4-5
            round2 = hvd.grouped_allreduce_async_(
                q_buffers,
                name=f"{self._name}.round2",
                op=self.op,
                process_set=self.process_set,
                **self._scale(),
            )
            self.compressor.update_error()  # step 6b, overlapping the Q collective
            q_avgs = _wait(round2)
            # step 6a, written straight into the parameters' gradients
            self.compressor.decompress(
                list(q_avgs), out={self._names[p]: p.grad for p in self._compressed}
            )
        elif self._compressing:
            kind = "compressed"  # nothing passed the rate test: P and Q are empty
        elements, sent, sent_bytes = self._per_step[kind]
        self._stats["steps"] += 1
        self._stats["elements_uncompressed"] += elements
        self._stats["elements_sent"] += sent
        self._stats["bytes_sent"] += sent_bytes
        self.powersgd_step += 1
        self._ready.clear()
        self._step_begun = False
        for p in self._params:
            self._delay[p] = self.config.backward_passes_per_step
        self._synchronized = True

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
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() after "
                    "optimizer.synchronize(): the gradients are communicated twice. Wrap the "
                    "step in `with optimizer.skip_synchronize():`.",
                    stacklevel=2,
                )
            self.synchronize()
        self._synchronized = False
        return self._base.step(self, closure)

    def zero_grad(self, set_to_none: bool = True):
        if self._ready or self._round1 is not None:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                "cause a race condition."
            )
        return self._base.zero_grad(self, set_to_none=set_to_none)

    # --- statistics and checkpoints --------------------------------------------------------
    def compression_stats(self) -> dict:
        """Totals over all steps so far, for this rank.

        Returns:
            dict with `steps`; `elements_uncompressed`, the gradient elements a
            plain all-reduce would have sent; `elements_sent`, the elements this
            rank handed to Horovod collectives (P, Q and uncompressed tensors);
            `bytes_sent`, the same in bytes at the dtype sent; and `ratio`,
            elements_uncompressed / elements_sent (0.0 before the first step).
        """
        stats = dict(self._stats)
        sent = stats["elements_sent"]
        stats["ratio"] = stats["elements_uncompressed"] / sent if sent else 0.0
        return stats

    def state_dict(self):
        """The wrapped optimizer's state plus this rank's PowerSGD state.

        The PowerSGD part (key ``"powersgd"``) holds the error buffers, Q
        memory, RNG states and step counter. Error buffers differ per rank:
        save every rank's (see `save_checkpoint`), not only rank 0's.
        """
        state = self._base.state_dict(self)
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
        """
        state_dict = dict(state_dict)
        ours = state_dict.pop(_STATE_KEY, None)
        if ours is not None:
            self.compressor.check_state_dict(ours["compressor"])
        self._round1 = None
        self._ready.clear()
        self._step_begun = False
        self._synchronized = False
        self._should_synchronize = True
        for p in self._params:
            self._delay[p] = self.config.backward_passes_per_step
        self._base.load_state_dict(self, state_dict)
        if ours is None:
            warnings.warn(
                "loading an optimizer state without PowerSGD state: error buffers and Q "
                "memory start fresh",
                stacklevel=2,
            )
            return
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

    On every sync (start, and after each change of workers) it does what the
    stock optimizer handler does, then checks that all ranks hold the same
    model and broadcasts the PowerSGD state that must agree across ranks.
    """

    def sync(self):
        self.value._check_same_model_on_every_rank()
        super().sync()
        self.value.broadcast_powersgd_state(root_rank=0)


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters=None,
    rank: int = 2,
    start_iter: int = 0,
    min_compression_rate: float = 2.0,
    error_feedback: bool = True,
    warm_start: bool = True,
    seed: int = 0,
    comm_dtype: torch.dtype | None = None,
    backward_passes_per_step: int = 1,
    op=hvd.Average,
    gradient_predivide_factor: float = 1.0,
    process_set=hvd.global_process_set,
):
    """Wrap a torch optimizer so that its gradients are averaged with PowerSGD.

    A drop-in for `hvd.DistributedOptimizer`: same launch, same
    `synchronize()` / `skip_synchronize()`, same `backward_passes_per_step`,
    `op`, `gradient_predivide_factor` and `process_set`. Each gradient of
    shape (n, ...) is viewed as an n x m matrix M (conv weights as
    out x in·kh·kw) and, if it shrinks at least `min_compression_rate`-fold,
    sent as P (n x r) and Q (m x r) instead of n·m numbers; 1-D tensors and
    small matrices travel uncompressed in the same collective as P.

    One step (W workers):
      1. M = grad + e (e: this worker's error buffer)      -- in the gradient hook
      2. P = M·Q (Q: warm-started from last step)          -- in the gradient hook
      3. all-reduce all P and all uncompressed gradients   -- one grouped collective,
         launched when the last gradient of the step is ready
      4. orthogonalise each P (batched over same-shape matrices)
      5. Q_w = Mᵀ·P; all-reduce all Q                       -- second grouped collective
      6. grad = P·Qᵀ; e = M − P·Q_wᵀ (computed while Q is in flight)
    Steps 1-2 overlap the backward pass; 4-6 need the summed P and run in
    `synchronize()` (called by `step()`).

    Choosing settings:
      * rank: 1-4 for CNNs (rank 2 matches SGD on ResNet-18/CIFAR-10 in the
        paper), 4-32 for transformers and LSTMs.
      * start_iter: plain all-reduce for this many steps; about the end of the
        learning-rate warm-up.
      * comm_dtype: torch.float16 halves the bytes of compressed steps (P, Q and
        the uncompressed gradients all travel in it; warm-up steps stay plain);
        orthogonalisation still runs in float32. Horovod 0.28 cannot all-reduce
        bfloat16, so that is refused.
    Memory added per compressed n x m parameter: n·m (error buffer) plus
    about 3·r·(n+m) (P, Q, Q memory), in float32 for 16-bit parameters.

    Args:
        optimizer: the torch optimizer to wrap (its param_groups are reused).
        named_parameters: (name, parameter) pairs, e.g. model.named_parameters();
            must name every parameter of the optimizer, uniquely.
        rank: matrix approximation rank r (>= 1), capped at min(n, m) per tensor.
        start_iter: steps of plain all-reduce before compression starts.
        min_compression_rate: compress an n x m gradient only if
            n·m >= min_compression_rate · r · (n + m).
        error_feedback: keep what compression dropped and add it back next step.
        warm_start: reuse last step's Q instead of a fresh random one.
        seed: seed of the random Q (must be, and is checked to be, equal on all ranks).
        comm_dtype: dtype compressed steps send P, Q and the uncompressed gradients
            in (None: the compute dtype for P/Q, each gradient's own for the rest).
        backward_passes_per_step: local backward passes (summed in p.grad) per step.
        op: hvd.Average or hvd.Sum (hvd.Adasum is not linear: ValueError).
        gradient_predivide_factor: with Average, divide by this before the sum
            and by size/factor after.
        process_set: the Horovod process set to reduce over; must include this rank.

    Returns:
        An optimizer of a class derived from `type(optimizer)`.

    Raises:
        ValueError: a bad setting, unnamed/duplicate/sparse parameters, or
            parameters or settings that differ across ranks (raised on every rank).

    Example:
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size(), momentum=0.9)
        >>> opt = horovod_powersgd.DistributedOptimizer(
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
    config = PowerSGDConfig(
        rank=rank,
        start_iter=start_iter,
        min_compression_rate=min_compression_rate,
        error_feedback=error_feedback,
        warm_start=warm_start,
        seed=seed,
        comm_dtype=comm_dtype,
        backward_passes_per_step=backward_passes_per_step,
        gradient_predivide_factor=gradient_predivide_factor,
    )
    if comm_dtype is not None and comm_dtype not in _REDUCIBLE:
        raise ValueError(
            f"comm_dtype={comm_dtype} cannot be sent: Horovod all-reduces only "
            f"{', '.join(str(d) for d in _REDUCIBLE)}; use torch.float16 to halve P/Q bytes"
        )
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError("gradient_predivide_factor is only supported with op=hvd.Average")
    if not isinstance(process_set, hvd.ProcessSet):
        raise ValueError(f"process_set must be a hvd.ProcessSet, got {process_set!r}")
    if not process_set.included():
        raise ValueError(
            f"this rank ({hvd.rank()}) is not in process_set {process_set!r}; build the "
            "optimizer only on the ranks of its process set"
        )
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
    return cls(optimizer.param_groups, named_parameters, config, op, process_set)


# hvd.elastic.TorchState picks the first handler whose type matches: ours first.
_elastic_state.set_handler_registry(
    [(_DistributedOptimizer, _PowerSGDStateHandler), *_elastic_state.get_handler_registry()]
)


def _wire_size(dtype: torch.dtype, comm_dtype: torch.dtype | None = None) -> int:
    return torch.empty(0, dtype=_wire_dtype(dtype, comm_dtype)).element_size()


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


def _first_difference(mine, other, my_rank, other_rank) -> str:
    if len(mine) != len(other):
        return (
            f"rank {my_rank} has {len(mine) - 1} parameters with gradients, "
            f"rank {other_rank} has {len(other) - 1}"
        )
    for a, b in zip(mine, other):
        if a != b:
            if a[0] == "config":
                return f"settings on rank {my_rank}: {a[1:]}; on rank {other_rank}: {b[1:]}"
            return (
                f"parameter {a[0]!r} {a[1:]} on rank {my_rank}, "
                f"{b[0]!r} {b[1:]} on rank {other_rank}"
            )
    return "unknown difference"


# --- collectives for other modules (only this module talks to Horovod) -------------------
def barrier(process_set) -> None:
    """Wait until every rank of `process_set` arrives."""
    hvd.barrier(process_set=process_set)


def allgather_object(obj, name: str, process_set) -> list:
    """`obj` of every rank of `process_set`, in rank order."""
    return hvd.allgather_object(obj, name=name, process_set=process_set)


def broadcast_object(obj, root_rank: int, name: str, process_set):
    """`root_rank`'s `obj` on every rank of `process_set`."""
    return hvd.broadcast_object(obj, root_rank=root_rank, name=name, process_set=process_set)
