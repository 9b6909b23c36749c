"""Checkpoints that resume every rank exactly: `save_checkpoint` / `load_checkpoint`.

Error buffers differ per worker, so besides the usual rank-0 file every rank
writes its own PowerSGD state beside it. A checkpoint id, written into the
main file and into every rank file (and their names), ties them together:
a rank file of another save is never loaded as if it belonged to this one.
"""

from __future__ import annotations

import collections
import contextlib
import os
import pickle
import re
import uuid
import warnings

import torch

from .comm import Collective
from .state import STATE_KEY as _STATE_KEY
from .state import shared_part

# What torch.load(weights_only=True) reads back, matched by exact type: a
# subclass (numpy.float64 is a float, a namedtuple a tuple) pickles as its own
# class, which that loader refuses.
_PLAIN_TYPES = (
    type(None), bool, int, float, complex, str, bytes, bytearray,
    torch.Tensor, torch.nn.Parameter, torch.Size, torch.dtype, torch.device,
)  # fmt: skip
_CONTAINERS = (list, tuple, set, dict, collections.OrderedDict)


def _rank_file(path: str, checkpoint_id: str, rank: int, size: int) -> str:
    # The id in the name keeps the previous checkpoint's files intact until the
    # new main file has replaced the old one.
    return f"{path}.powersgd-{checkpoint_id}-rank{rank}-of-{size}"


def save_checkpoint(path: str, model: torch.nn.Module, optimizer, **extra) -> None:
    """Save a checkpoint that resumes every rank exactly; call it on every rank.

    Every rank writes its own PowerSGD state (error buffers differ per rank)
    to `path.powersgd-{id}-rank{r}-of-{W}`; once all have, rank 0 writes
    `path` (model, optimizer and `extra`, like the usual rank-0 checkpoint),
    then the rank files of earlier saves to `path` are removed. `id` is new
    for every save and is recorded, with the step counter and `W`, in every
    file. Each file is written to a temporary name and renamed, so a crash
    while saving leaves the previous checkpoint loadable as it was.

    Args:
        path: the main file; rank files go beside it. On several machines,
            a directory every rank can read and write.
        model: the model; its `state_dict()` is saved.
        optimizer: a `horovod_powersgd.DistributedOptimizer`.
        **extra: anything else to restore (epoch, scheduler state, ...), given
            back by `load_checkpoint`. Since the main file is read with
            `torch.load(weights_only=True)`, it may hold only what that reads:
            tensors, numbers, strings, bytes, bools, None, `torch.Size`,
            dtypes, devices, and lists, tuples, sets and dicts of them (for
            objects, save their `state_dict()`).

    Raises:
        ValueError: `extra` holds anything else; raised on every rank before
            anything is written.
        OSError: a rank could not write its file; raised on every rank, and
            the previous checkpoint is kept.
        TimeoutError: the other ranks did not call it within
            HOROVOD_POWERSGD_CHECKPOINT_TIMEOUT seconds (default 300; 0: no
            limit), as when it is called under `if hvd.rank() == 0:`. The
            message says what to call instead; once this rank's process ends,
            Horovod ends the others' collectives with an error too.

    Example:
        >>> horovod_powersgd.save_checkpoint("ckpt.pt", model, opt, epoch=epoch)
        >>> extra = horovod_powersgd.load_checkpoint("ckpt.pt", model, opt)  # on resume
        >>> epoch = extra["epoch"]
    """
    comm = _collective(optimizer, "save_checkpoint")
    process_set = comm.process_set
    rank, size = process_set.rank(), process_set.size()
    name = f"powersgd.checkpoint.{process_set.process_set_id}.save"
    try:
        problem = _not_loadable(extra, "extra")
    except RecursionError:  # raised here alone, it would leave the other ranks waiting
        problem = "extra refers to itself or is nested too deeply"
    if problem:
        problem = ValueError(
            f"{problem}, which torch.load(weights_only=True) cannot read back; extra may hold "
            "tensors, numbers, strings, bools, None and lists/tuples/dicts of them (save an "
            "object's state_dict(), convert numpy scalars with float())"
        )
    _agree(problem, f"{name}.extra", comm)

    checkpoint_id = comm.broadcast_object(uuid.uuid4().hex[:12], f"{name}.id")
    state = optimizer.state_dict()
    ours = state.pop(_STATE_KEY)
    checkpoint = {"id": checkpoint_id, "step": ours["step"], "world_size": size}
    own = {"checkpoint": checkpoint, "rank": rank, _STATE_KEY: ours}
    _agree(_try_save(own, _rank_file(path, checkpoint_id, rank, size)), f"{name}.ranks", comm)
    # Only now, with every rank file in place, may the main file point to them.
    # Its optimizer state keeps the shared PowerSGD state (step counter, Q
    # memory, RNG; equal on every rank), so that Horovod's usual resume from it
    # (rank 0 loads `["optimizer"]`) goes on with the same step and memories;
    # only the error buffers, which differ per rank, live in the rank files alone.
    state[_STATE_KEY] = shared_part(ours)
    main = {
        "checkpoint": checkpoint,
        "model": model.state_dict(),
        "optimizer": state,
        "extra": extra,
    }
    _agree(_try_save(main, path) if rank == 0 else None, name, comm)
    _remove_other_rank_files(path, checkpoint_id)


def load_checkpoint(path: str, model: torch.nn.Module, optimizer, map_location=None) -> dict:
    """Restore a `save_checkpoint` checkpoint on every rank; returns its `extra`.

    Reads `path` and the rank files of the checkpoint it records (by id,
    step and world size; never a file of another save), each with
    `torch.load(weights_only=True)`, which builds tensors and plain data
    only and so cannot run code from the file.

    - Same number of workers, own rank file present: resumes bit for bit.
    - Same number of workers, own rank file missing or of another checkpoint:
      takes Q memory, RNG states and step counter from another rank's file
      of this checkpoint (they are equal on every rank), resets this rank's
      error buffers to zero, and warns naming the file.
    - Another number of workers: every rank does so, and `load_state_dict`
      warns that the error buffers were reset.

    All ranks agree before anything changes: if any rank cannot load, every
    rank raises, naming that rank and the cause, and no state changes.

    Args:
        path: the main file given to `save_checkpoint`.
        model: the model to restore (same architecture as saved).
        optimizer: the `horovod_powersgd.DistributedOptimizer` to restore.
        map_location: as for `torch.load`; default the device of the model.

    Returns:
        The `extra` keyword arguments given to `save_checkpoint`, as a dict.

    Raises:
        FileNotFoundError: `path`, or every rank file of its checkpoint, is missing.
        ValueError: a file cannot be read safely, or does not fit the model.
        TimeoutError: the other ranks did not call it in time (see `save_checkpoint`).

    Example:
        >>> extra = horovod_powersgd.load_checkpoint("ckpt.pt", model, opt)
        >>> start_epoch = extra["epoch"] + 1
    """
    comm = _collective(optimizer, "load_checkpoint")
    process_set = comm.process_set
    rank, size = process_set.rank(), process_set.size()
    if map_location is None:
        map_location = next(model.parameters()).device
    main = ours = note = problem = None
    try:
        powersgd = optimizer.powersgd_state
        main, ours, note = _read(path, rank, size, map_location, powersgd.fits)
        powersgd.check(ours)
        _check_model(model, main["model"], path)
    except FileNotFoundError as e:
        problem = FileNotFoundError(str(e))
    except Exception as e:  # any failure must reach the other ranks, not leave them waiting
        problem = ValueError(str(e))
    name = f"powersgd.checkpoint.{process_set.process_set_id}.load"
    _agree(problem, name, comm)
    # Every rank warns alike about what any rank reset: a warning on one rank
    # only would, under -W error, raise there and leave the others waiting.
    notes = [n for n in comm.allgather_object(note, f"{name}.notes") if n]

    # Optimizer first: it validates before changing anything, and the model
    # (checked above) cannot fail after it.
    optimizer_state = dict(main["optimizer"])
    optimizer_state[_STATE_KEY] = ours
    optimizer.load_state_dict(optimizer_state)
    if note:
        optimizer.compressor.reset_error()
    if notes:
        warnings.warn("; ".join(notes), stacklevel=2)
    model.load_state_dict(main["model"])
    return main["extra"]


def _read(path: str, rank: int, size: int, map_location, fits):
    """(main file, PowerSGD state for this rank, warning or None); raises what stops a load.

    `fits(state)`: whether another rank's PowerSGD state holds this rank's
    matrices (hierarchical PowerSGD: only the ranks of the same share do).
    """
    main = _load(path, map_location)
    if not (isinstance(main, dict) and isinstance(main.get("checkpoint"), dict)):
        raise ValueError(f"{path} has no checkpoint id: not written by this save_checkpoint")
    checkpoint = main["checkpoint"]
    saved_size = checkpoint["world_size"]
    names = [_rank_file(path, checkpoint["id"], r, saved_size) for r in range(saved_size)]
    reasons = {}  # file -> why it cannot be used, reported in rank order
    if size == saved_size:
        own, reasons[names[rank]] = _read_rank_file(names[rank], checkpoint, map_location, rank)
        if own is not None:
            return main, own[_STATE_KEY], None
    # Own file unusable, or a resized job whose residuals cannot carry over
    # (load_state_dict resets them and warns): any rank's file of this
    # checkpoint has the shared state.
    for name in names:
        if name not in reasons:
            shared, reasons[name] = _read_rank_file(name, checkpoint, map_location)
            if shared is not None and not fits(shared[_STATE_KEY]):
                shared, reasons[name] = None, f"{name} holds another share's matrices"
            if shared is not None:
                break
    else:
        raise FileNotFoundError(
            f"no PowerSGD state of checkpoint {checkpoint['id']} (step {checkpoint['step']}, "
            f"{saved_size} workers) beside {path}: " + "; ".join(reasons[name] for name in names)
        )
    note = None
    if size == saved_size:
        note = (
            f"rank {rank}: {reasons[names[rank]]}; took the Q memory, RNG states and step "
            f"counter ({checkpoint['step']}) from {name} and reset this rank's PowerSGD error "
            "buffers to zero"
        )
    return main, shared[_STATE_KEY], note


def _read_rank_file(name: str, checkpoint: dict, map_location, rank: int | None = None):
    """(contents, None) if `name` is a rank file of `checkpoint` (of `rank`), else (None, why)."""
    if not os.path.exists(name):
        return None, f"{name} is missing"
    saved = _load(name, map_location)
    if not (isinstance(saved, dict) and {"checkpoint", "rank", _STATE_KEY} <= saved.keys()):
        raise ValueError(f"{name} is not a horovod_powersgd rank file")
    if saved["checkpoint"] != checkpoint:
        return None, (
            f"{name} is of another checkpoint ({saved['checkpoint'].get('id')}, step "
            f"{saved['checkpoint'].get('step')}), not of {checkpoint['id']}"
        )
    if rank is not None and saved["rank"] != rank:
        return None, f"{name} holds the state of rank {saved['rank']}"
    return saved, None


def _load(name: str, map_location):
    try:
        return torch.load(name, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        lines = str(e).splitlines()
        reason = next((line for line in lines if "GLOBAL" in line), lines[0] if lines else "")
        raise ValueError(
            f"{name} holds objects that torch.load(weights_only=True) refuses to build "
            f"(checkpoint files are read as tensors and plain data only): {reason}"
        ) from e


def _check_model(model: torch.nn.Module, saved: dict, path: str) -> None:
    """What `model.load_state_dict(saved)` would refuse, raised before it copies anything."""
    own = model.state_dict()
    if own.keys() != saved.keys():
        missing, unexpected = sorted(own.keys() - saved.keys()), sorted(saved.keys() - own.keys())
        raise ValueError(
            f"{path} holds another model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for key, tensor in own.items():
        shape = getattr(saved[key], "shape", None)
        if isinstance(tensor, torch.Tensor) and tuple(shape or ()) != tuple(tensor.shape):
            raise ValueError(
                f"{path} holds another model: {key!r} has shape {tuple(shape or ())}, "
                f"this model's {tuple(tensor.shape)}"
            )


def _not_loadable(value, where: str) -> str | None:
    """Where in `value` something is that torch.load(weights_only=True) would refuse."""
    kind = type(value)
    if kind in _PLAIN_TYPES:
        return None
    if kind not in _CONTAINERS:
        return f"{where} is a {kind.__module__}.{kind.__qualname__}"
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in items:
        if isinstance(value, dict) and _not_loadable(key, where):
            return f"{where} has a key of type {type(key).__qualname__}"
        problem = _not_loadable(item, f"{where}[{key!r}]")
        if problem:
            return problem
    return None


# How long save_checkpoint / load_checkpoint wait for the other ranks in one collective.
TIMEOUT_ENV = "HOROVOD_POWERSGD_CHECKPOINT_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0


def _collective(optimizer, what: str) -> Collective:
    """The collectives of `what` over the optimizer's process set, with their deadline."""
    process_set = optimizer.process_set
    if not process_set.included():
        # The ranks of the set would wait for it in collectives it cannot join.
        raise ValueError(
            f"{what}: this rank is not in the optimizer's process set; call it on its ranks only"
        )
    raw = os.environ.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_S))
    try:
        timeout = float(raw)
    except ValueError:
        timeout = -1.0
    if not timeout >= 0:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds >= 0 (0: none), got {raw!r}")
    # A user following Horovod's habit of saving under `if hvd.rank() == 0:` would
    # otherwise wait for ever in the first collective, and the others in their next one.
    hint = (
        " (not under `if hvd.rank() == 0:`: each rank saves and loads its own error "
        "buffers). For a rank-0 file, as Horovod's examples write, torch.save "
        "opt.state_dict() on rank 0, and resume with opt.load_state_dict on rank 0 and "
        "hvd.broadcast_optimizer_state (every rank's error buffers then start at zero). "
        f"If the other ranks are only slower, set {TIMEOUT_ENV} (seconds, 0: no limit; "
        f"now {timeout:g})."
    )
    return Collective(what, process_set, timeout or None, hint)


def _agree(problem: Exception | None, name: str, comm: Collective) -> None:
    """Raise on every rank if `problem` is set on any rank, naming the ranks and causes.

    One collective that every rank reaches, whatever happened before it, so
    no rank is left waiting for one that failed.
    """
    what = comm.what
    mine = None if problem is None else (type(problem), str(problem))
    problems = comm.allgather_object(mine, name)
    failed = collections.defaultdict(list)  # (type, message) -> ranks
    for rank, found in enumerate(problems):
        if found is not None:
            failed[found].append(rank)
    if not failed:
        return
    kinds = {kind for kind, _ in failed}
    kind = kinds.pop() if len(kinds) == 1 else ValueError
    raise kind(
        f"{what} failed "
        + "; ".join(f"on rank(s) {ranks}: {message}" for (_, message), ranks in failed.items())
    )


def _try_save(obj, path: str) -> Exception | None:
    """Write `obj` to `path` atomically; the error instead of raising it (see `_agree`)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except Exception as e:  # disk full is a RuntimeError from torch's zip writer
        if os.path.exists(tmp):
            os.remove(tmp)
        return OSError(f"cannot write {path}: {e}")
    return None


def _remove_other_rank_files(path: str, checkpoint_id: str) -> None:
    """Remove rank files (and temporaries of crashed saves) of earlier saves to `path`."""
    directory = os.path.dirname(path) or "."
    pattern = re.compile(
        re.escape(os.path.basename(path)) + r"\.powersgd-([0-9a-f]{12})-rank\d+-of-\d+(\.tmp\d+)?"
    )
    for entry in os.listdir(directory):
        found = pattern.fullmatch(entry)
        if found and found.group(1) != checkpoint_id:
            # Other ranks sharing the directory may remove it first.
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(directory, entry))
