"""Ranks whose parameters drift apart: found by a checksum every N steps, repaired from rank 0.

With plain Horovod every rank applies the same all-reduced gradient, so the
parameters stay bitwise identical. With PowerSGD each rank rebuilds the
gradient P̂·Q_avgᵀ itself (and orthogonalises P itself, with rounds=2), and
a matrix product's last bits depend on the processor, the BLAS kernel and the
number of threads. Ranks that differ in any of these drift apart by rounding
errors that compound (issue 23: 7.5e-9 after 15 steps with 1 thread on one
rank and 2 on the other).

No Horovod here: the optimizer hands in its collectives, like the schedule.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Integer views of the same width: a checksum of the bits, so that any change
# of any element changes it (a float sum would round small changes away).
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def checksum(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-d int64 tensor on `tensor`'s device: the sum of its elements' bit patterns.

    The sum wraps around on overflow, which keeps it exact and the same on
    every rank. Any single changed element changes it.
    """
    flat = tensor.detach().reshape(-1)
    if not flat.is_floating_point() and flat.dtype not in _BITS.values():
        flat = flat.to(torch.int64)
    bits = flat.view(_BITS[flat.element_size()])
    return bits.sum(dtype=torch.int64)


class DriftGuard:
    """Compares the parameters (and their optimizer state) across ranks every `every` steps.

    Args:
        named: (name, parameter) pairs, in an order equal on every rank.
        every: steps between checks (0: never).
        allgather: (int64 tensor of shape (1, k), name) -> (ranks, k) tensor.
        broadcast: (tensors, name) -> None, in place from the first rank.
    """

    def __init__(self, named, every: int, *, allgather: Callable, broadcast: Callable):
        self.named = list(named)
        self.every = every
        self.allgather, self.broadcast = allgather, broadcast
        self.checks = 0  # checks done so far
        self.repairs = 0  # checks that found and repaired a difference

    def due(self, step: int) -> bool:
        """Whether communication step `step` (counted from 1, equal on every rank) checks."""
        return self.every > 0 and step % self.every == 0

    def check(self, state: dict) -> list[str]:
        """One check: the names that differed from the first rank's, now repaired.

        Args:
            state: parameter -> its optimizer state (the wrapped optimizer's
                `state`); the tensors in it are compared and repaired too.
        """
        self.checks += 1
        sums = []
        for _, p in self.named:
            total = checksum(p)
            for value in state.get(p, {}).values():
                if isinstance(value, torch.Tensor):
                    total = total + checksum(value).to(total.device)
            sums.append(total)
        # One tensor on the first parameter's device: a single transfer, every `every` steps.
        device = sums[0].device
        mine = torch.stack([s.to(device) for s in sums]).view(1, -1)
        everyone = self.allgather(mine, f"drift.{self.checks}")
        differs = (everyone != everyone[0:1]).any(dim=0).tolist()
        names = [name for (name, _), bad in zip(self.named, differs) if bad]
        if names:
            self.repairs += 1
            tensors = []
            for (_, p), bad in zip(self.named, differs):
                if bad:
                    tensors.append(p.data)
                    tensors.extend(
                        v for v in state.get(p, {}).values() if isinstance(v, torch.Tensor)
                    )
            self.broadcast(tensors, f"drift.repair.{self.checks}")
        return names
