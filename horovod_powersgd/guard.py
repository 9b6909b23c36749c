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


def checksum(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-d int32 tensor on `tensor`'s device: the sum of its bit patterns, modulo 2^32.

    The bits are read as 32-bit integers (16-bit ones where the size is not a
    multiple of 4 bytes) and summed in that width, which wraps around: integer
    addition modulo 2^32 is exact in any order, so every rank gets the same sum
    for the same bits, and any single changed element changes it. (Summing in
    the integers' own width is also what keeps it fast: a widening integer sum
    is not vectorised and takes about 100 times longer on the CPU.)
    """
    flat = tensor.detach().reshape(-1)
    if flat.numel() * flat.element_size() % 4 == 0:
        return flat.view(torch.int32).sum(dtype=torch.int32)
    return flat.view(torch.int16).sum(dtype=torch.int32)


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
        device = self.named[0][1].device
        sums, owners = [], []  # a checksum per tensor, and the parameter it belongs to
        for index, (_, p) in enumerate(self.named):
            tensors = [p, *(v for v in state.get(p, {}).values() if isinstance(v, torch.Tensor))]
            for tensor in tensors:
                sums.append(checksum(tensor).to(device))
                owners.append(index)
        # Per parameter: its own and its state's sums, modulo 2^32, as int64 for the wire.
        owner = torch.tensor(owners, device=device)
        mine = torch.zeros(len(self.named), dtype=torch.int32, device=device)
        mine = mine.index_add_(0, owner, torch.stack(sums)).to(torch.int64).view(1, -1)
        # Fixed names: a per-process count would differ on a worker that joined later.
        everyone = self.allgather(mine, "drift")
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
            self.broadcast(tensors, "drift.repair")
        return names
