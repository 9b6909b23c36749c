"""Ranks whose parameters drift apart: found by a fingerprint every N steps, repaired.

With plain Horovod every rank applies the same all-reduced gradient, so the
parameters stay bitwise identical. With PowerSGD each rank rebuilds the
gradient P̂·Q_avgᵀ itself (and orthogonalises P itself, with rounds=2), and
a matrix product's last bits depend on the processor, the BLAS kernel and the
number of threads. Ranks that differ in any of these drift apart by rounding
errors that compound (7.5e-9 after 15 steps with 1 thread on one rank and 2 on
the other: docs/reliability.md).

No Horovod here: the optimizer hands in its collectives (`comm.Comm`).
"""

from __future__ import annotations

import hashlib

import torch

# A tensor of more than this many 32-bit words is folded to the sums of its
# rows and of its columns when viewed as (rows, _COLUMNS); smaller ones are
# fingerprinted word for word.
_COLUMNS = 4096


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The bits of `tensor` as a flat int32 tensor (a ragged tail of bytes zero-padded)."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() * flat.element_size() % 4 == 0:
        return flat.view(torch.int32)
    raw = flat.view(torch.uint8)  # 1- and 2-byte elements of an odd count (bool, float16)
    padded = torch.zeros(-(-raw.numel() // 4) * 4, dtype=torch.uint8, device=raw.device)
    padded[: raw.numel()] = raw
    return padded.view(torch.int32)


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """A short int32 tensor, on `tensor`'s device, that changes whenever its bits do.

    The bits are read as 32-bit words. Up to `_COLUMNS` words they are the
    fingerprint. Longer tensors are viewed as rows of `_COLUMNS` words, and the
    fingerprint is each row's sum, each column's sum (both modulo 2^32) and the
    words of the ragged tail. Integer sums are exact in any order, so every
    rank gets the same fingerprint for the same bits, on any device and thread
    count. Any one changed word changes its row's sum; two changed words in
    different rows change two row sums, in one row two column sums, so no pair
    of changes, of any size and sign, cancels (the position-free sum it
    replaces missed half of the pairs of opposite one-ulp changes). Hashing the
    fingerprints (see `DriftGuard.check`) turns them into a few numbers.
    About 2·sqrt(numel) words for a large tensor, two passes over it. A
    sparse tensor (SGD's momentum of sparse gradients) is fingerprinted by its
    coalesced indices and values.
    """
    if tensor.is_sparse:
        tensor = tensor.coalesce()
        return torch.cat([fingerprint(tensor.indices()), fingerprint(tensor.values())])
    words = _words(tensor)
    rows = words.numel() // _COLUMNS
    if rows <= 1:
        return words
    block = words[: rows * _COLUMNS].view(rows, _COLUMNS)
    return torch.cat(
        [block.sum(1, dtype=torch.int32), block.sum(0, dtype=torch.int32), words[rows * _COLUMNS :]]
    )


def _digest(data: bytes) -> int:
    """The first 8 bytes of data's SHA-256, as a signed int64."""
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little", signed=True)


def _describe(tensors: dict[str, torch.Tensor]) -> str:
    return ", ".join(f"{k} {tuple(t.shape)} {t.dtype}" for k, t in tensors.items()) or "nothing"


class DriftGuard:
    """Compares the parameters (and their optimizer state) across ranks every `every` steps.

    Args:
        named: (name, parameter) pairs, in an order equal on every rank.
        every: steps between checks (0: never).
        comm: the collectives (`comm.Comm`): `allgather` (an int64 tensor of
            shape (1, k), name) -> (ranks, k) tensor, and `broadcast_` (tensors,
            name), in place from the first rank.
    """

    def __init__(self, named, every: int, comm):
        self.named = list(named)
        self.every = every
        self.comm = comm
        self.checks = 0  # checks done so far
        self.repairs = 0  # checks that found and repaired a difference
        self.requested = False  # check after the next step too (the ranks just agreed)
        self.extra: list[list[int]] = []  # every rank's `extra` words at the last check
        self.pending = False  # the next step() checks

    def due(self, step: int) -> bool:
        """Whether communication step `step` (counted from 1, equal on every rank) checks."""
        return self.every > 0 and step % self.every == 0

    def request(self) -> None:
        """Check after the next step as well: the ranks just agreed on their state.

        A resume can leave ranks with different weights (with weight decay,
        hvd.broadcast_optimizer_state's initialising step on zero gradients moves
        those of ranks that had no optimizer state).
        """
        self.requested = True

    def note_step(self, step: int) -> None:
        """Communication step `step` is done; the check follows the update its step() makes.

        One that is due stays due until a step() runs (`pending`): GradScaler
        skips steps on every rank alike, and the check after a resume must not
        be lost with the first.
        """
        self.pending = self.every > 0 and (self.pending or self.requested or step % self.every == 0)
        self.requested = False

    @staticmethod
    def _state_tensors(p: torch.Tensor, state: dict) -> dict[str, torch.Tensor]:
        """The tensors of p's optimizer state by key, sorted: the same order on every rank."""
        entries = state.get(p, {})
        return {k: entries[k] for k in sorted(entries, key=str) if torch.is_tensor(entries[k])}

    def check(self, state: dict, extra: list[int] = ()) -> list[str]:
        """One check: the names that differed from the first rank's, now repaired.

        Args:
            state: parameter -> its optimizer state (the wrapped optimizer's
                `state`); the tensors in it are compared and repaired too.
            extra: int64 words to gather in the same all-gather (a digest of the
                optimizer's settings); every rank's are in `self.extra` after it.

        Raises:
            ValueError: on every rank alike, when a parameter's optimizer state
                holds other tensors on some ranks (other optimizer settings, or
                another state loaded): nothing could be repaired in place.
        """
        self.checks += 1
        self.pending = False
        device = self.named[0][1].device
        layouts, prints, sizes = [], [], []
        for _, p in self.named:
            tensors = self._state_tensors(p, state)
            layouts.append(_digest(_describe(tensors).encode() + str(p.dtype).encode()))
            parts = [fingerprint(t).to(device) for t in (p, *tensors.values())]
            prints.extend(parts)
            sizes.append(sum(part.numel() for part in parts))
        # One copy to the host for all of them, then a hash per parameter.
        host = torch.cat(prints).cpu().numpy()
        values, offset = [], 0
        for size in sizes:
            values.append(_digest(host[offset : offset + size].tobytes()))
            offset += size
        mine = torch.tensor([layouts + values + list(extra)], dtype=torch.int64, device=device)
        # Fixed names: a per-process count would differ on a worker that joined later.
        everyone = self.comm.allgather(mine, "drift").tolist()  # the one read of the result
        count = len(self.named)
        self.extra = [row[2 * count :] for row in everyone]
        differ = [any(row[j] != everyone[0][j] for row in everyone) for j in range(2 * count)]
        for j, (name, p) in enumerate(self.named):
            if differ[j]:
                column = [row[j] for row in everyone]
                ranks = [r for r, layout in enumerate(column) if layout != column[0]]
                raise ValueError(
                    f"the optimizer state of parameter {name!r} holds other tensors on some "
                    f"ranks than on the first (here: {_describe(self._state_tensors(p, state))}; "
                    f"other on ranks {ranks} of the process set): "
                    "the wrapped optimizer's settings differ across ranks (amsgrad, momentum, "
                    "...) or a rank loaded another optimizer state; build the same optimizer "
                    "on every rank"
                )
        differs = differ[count:]
        names = [name for (name, _), bad in zip(self.named, differs) if bad]
        if names:
            self.repairs += 1
            tensors, sparse = [], []
            for (_, p), bad in zip(self.named, differs):
                if bad:
                    tensors.append(p.data)
                    for key, t in self._state_tensors(p, state).items():
                        if t.is_sparse:  # broadcast dense, set back sparse
                            sparse.append((state[p], key, t.to_dense()))
                            t = sparse[-1][2]
                        tensors.append(t)
            self.comm.broadcast_(tensors, "drift.repair")
            for entries, key, dense in sparse:
                entries[key] = dense.to_sparse()
        return names
