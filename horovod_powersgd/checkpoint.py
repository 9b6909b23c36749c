"""Checkpoints that resume every rank exactly: `save_checkpoint` / `load_checkpoint`.

Error buffers differ per worker, so besides the usual rank-0 file every rank
writes its own PowerSGD state beside it.
"""

from __future__ import annotations

import os

import torch

from .optimizer import _STATE_KEY, barrier


def _rank_file(path: str, rank: int, size: int) -> str:
    return f"{path}.powersgd-rank{rank}-of-{size}"


def save_checkpoint(path: str, model: torch.nn.Module, optimizer, **extra) -> None:
    """Save a checkpoint that resumes every rank exactly; call it on every rank.

    Rank 0 writes `path` (model, optimizer and `extra`, like the usual
    rank-0 checkpoint); every rank also writes its own PowerSGD state
    (error buffers differ per rank) to `path.powersgd-rank{r}-of-{W}`.
    Files are written to a temporary name and renamed, so a crash while
    saving never destroys the previous checkpoint. Returns once all ranks
    have written (a barrier).

    Example:
        >>> horovod_powersgd.save_checkpoint("ckpt.pt", model, opt, epoch=epoch)
        >>> extra = horovod_powersgd.load_checkpoint("ckpt.pt", model, opt)  # on resume
    """
    process_set = optimizer.process_set
    state = optimizer.state_dict()
    ours = state.pop(_STATE_KEY)
    rank, size = process_set.rank(), process_set.size()
    _atomic_save(ours, _rank_file(path, rank, size))
    if rank == 0:
        _atomic_save({"model": model.state_dict(), "optimizer": state, "extra": extra}, path)
    barrier(process_set)


def load_checkpoint(path: str, model: torch.nn.Module, optimizer, map_location=None) -> dict:
    """Restore a `save_checkpoint` checkpoint on every rank; returns its `extra`.

    Each rank reads `path` and its own PowerSGD file. With a different number
    of workers than at save time, the error buffers start from zero (see
    `load_state_dict`); everything else is restored.
    """
    process_set = optimizer.process_set
    rank, size = process_set.rank(), process_set.size()
    if map_location is None:
        map_location = next(model.parameters()).device
    common = torch.load(path, map_location=map_location, weights_only=False)
    own = _rank_file(path, rank, size)
    if os.path.exists(own):
        ours = torch.load(own, map_location=map_location, weights_only=False)
    else:
        # Resized job: take rank 0's file of the old world (Q memory and RNG are
        # identical on every rank); load_state_dict resets the residuals.
        saved = sorted(
            f
            for f in os.listdir(os.path.dirname(os.path.abspath(path)) or ".")
            if f.startswith(os.path.basename(path) + ".powersgd-rank0-of-")
        )
        if not saved:
            raise FileNotFoundError(f"no PowerSGD state beside {path} (expected {own})")
        ours = torch.load(
            os.path.join(os.path.dirname(os.path.abspath(path)), saved[0]),
            map_location=map_location,
            weights_only=False,
        )
    optimizer_state = dict(common["optimizer"])
    optimizer_state[_STATE_KEY] = ours
    optimizer.compressor.check_state_dict(ours["compressor"])
    model.load_state_dict(common["model"])
    optimizer.load_state_dict(optimizer_state)
    return common["extra"]


def _atomic_save(obj, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)
