"""Hierarchical PowerSGD's shares of a node's work, from tensor sizes and shapes alone (pure).

`hierarchy.py` splits each bucket among a node's L workers and lays out the
node's collectives by these functions; `bench/scale.py` predicts a hierarchical
step from the same functions and a profile's tensor sizes, so the model charges
the shares and the node's collectives the library makes (docs/scale.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

SPLIT = -1  # an owner: the tensor is split by rows, a block to every share (`blocks`)
SPLIT_COLUMNS = -2  # ... by columns (a wide matrix: 2-D tensors only)
# The most a split may add to its tensor's factor bytes: each block is its own rank-r
# matrix, so the node sends L Qs (m x r each; by columns, L Ps) where one worker would
# send one; the other factor is shared out. Relative to (n + m)·r, whatever the rank.
SPLIT_COST = 1 / 8


def owners(
    buckets: Sequence[Sequence[int]],
    local_size: int,
    shapes: Sequence[Sequence[Sequence[int]]] | None = None,
) -> list[list[int]]:
    """Per bucket (its tensors' element counts, in bucket order), each tensor's owner:
    the local rank whose share it is, SPLIT or SPLIT_COLUMNS.

    A tensor larger than its bucket's total / L cannot be one share of a balanced
    node: given `shapes` (each tensor's shape) it is split, a block of its rows (or
    of a wide matrix's columns) to every share (`blocks`), where `split_of` allows.
    The others go largest first to the least loaded (ties: the least loaded over the
    buckets before, then the lowest rank).

    Example:
        >>> owners([[100, 60, 50], [10]], 2), owners([[100, 10]], 2, [[(50, 2), (10,)]])
        ([[0, 1, 1], [0]], [[-1, 0]])
    """
    total = [0] * local_size
    out = []
    for b, sizes in enumerate(buckets):
        load = [0] * local_size
        owner = [0] * len(sizes)
        whole = sum(sizes)
        for i, n in enumerate(sizes):
            kind = split_of(shapes[b][i], local_size) if shapes is not None else None
            if kind is None or n * local_size <= whole:
                continue
            owner[i] = kind
            for j, width in enumerate(block_sizes(n, shapes[b][i], kind, local_size)):
                load[j] += width
                total[j] += width
        for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):  # stable: ties keep order
            if owner[i] < 0:
                continue
            j = min(range(local_size), key=lambda j: (load[j], total[j], j))
            owner[i] = j
            load[j] += sizes[i]
            total[j] += sizes[i]
        out.append(owner)
    return out


def matrix(shape: Sequence[int]) -> tuple[int, int]:
    """(n, m) of a tensor's matrix view: first dimension by the rest (1 x 1 for a scalar).

    Example:
        >>> matrix((64, 32, 3, 3)), matrix((7,)), matrix(())
        ((64, 288), (7, 1), (1, 1))
    """
    return (shape[0] if shape else 1), math.prod(shape[1:])


def split_of(shape: Sequence[int], local_size: int) -> int | None:
    """SPLIT where a tensor of `shape` may be split by rows among L workers (`splits`),
    else SPLIT_COLUMNS where a 2-D one may be by columns, else None.

    Example:
        >>> split_of((50257, 768), 8), split_of((256, 6272), 2), split_of((64, 64, 3, 3), 2)
        (-1, -2, None)
    """
    n, m = matrix(shape)
    if splits(n, m, local_size):
        return SPLIT
    if len(shape) == 2 and splits(m, n, local_size):
        return SPLIT_COLUMNS
    return None


def block_sizes(numel: int, shape: Sequence[int], kind: int, local_size: int) -> list[int]:
    """Elements of each share's block of a tensor split by rows or columns (`kind`)."""
    count = matrix(shape)[0 if kind == SPLIT else 1]
    return [numel // count * (stop - start) for start, stop in blocks(count, local_size)]


def splits(n: int, m: int, local_size: int) -> bool:
    """Whether an n x m matrix may be split by rows among L workers: a row each at least,
    and its L-1 extra Qs at most SPLIT_COST of its factors (an embedding of 50,257 x 768
    at L = 8, not a 1,000 x 2,048 classifier).

    Example:
        >>> splits(50257, 768, 8), splits(1000, 2048, 2), splits(4096, 1, 2)
        (True, False, True)
    """
    return n >= local_size and (local_size - 1) * m <= SPLIT_COST * (n + m)


def blocks(rows: int, local_size: int) -> list[tuple[int, int]]:
    """A split tensor's rows (or columns), [start, stop) per share: as even as can be, the
    first shares a row more.

    Example:
        >>> blocks(7, 3)
        [(0, 3), (3, 5), (5, 7)]
    """
    base, extra = divmod(rows, local_size)
    out, start = [], 0
    for j in range(local_size):
        stop = start + base + (j < extra)
        out.append((start, stop))
        start = stop
    return out


def rows(sizes: Sequence[int], owner: Sequence[int], local_size: int) -> list[int]:
    """Elements of each local rank's share of one pack (its row, before padding)."""
    out = [0] * local_size
    for n, j in zip(sizes, owner):
        out[j] += n
    return out


def padded_work(sizes: Sequence[int], owner: Sequence[int], local_size: int) -> tuple[int, int]:
    """(elements a worker sends scattered, ... reduced whole), per node stage, times L.

    Scattered: L rows of the longest share, reduce-scattered and all-gathered,
    (L-1)·longest a worker and stage; whole: the pack all-reduced twice, 2(L-1)/L
    of it a worker and stage.
    """
    longest, total = max(1, *rows(sizes, owner, local_size)), max(1, sum(sizes))
    return local_size * (local_size - 1) * longest, 2 * (local_size - 1) * total


def scatters(packs: Sequence[tuple[Sequence[int], Sequence[int]]], local_size: int) -> bool:
    """Whether a bucket's packs ((sizes, owners) of each dtype) are scattered, not reduced
    whole: only where that sends fewer bytes. A tie (one tensor's bucket at L = 2) goes
    to the all-reduces, the collective every library tunes most (docs/hierarchical.md:
    the padded reduce-scatter of a 75 MB tensor took 3-6x an all-reduce of it).

    Example:
        >>> scatters([([100, 100], [0, 1])], 2), scatters([([100], [0])], 2)
        (True, False)
    """
    work = [padded_work(sizes, owner, local_size) for sizes, owner in packs]
    return sum(w[0] for w in work) < sum(w[1] for w in work)
