"""Hierarchical PowerSGD's shares of a node's work, from tensor sizes alone (pure).

`hierarchy.py` splits each bucket among a node's L workers and lays out the
node's collectives by these functions; `bench/scale.py` predicts a hierarchical
step from the same functions and a profile's tensor sizes, so the model charges
the shares and the node's collectives the library makes (docs/scale.md).
"""

from __future__ import annotations

from collections.abc import Sequence


def owners(buckets: Sequence[Sequence[int]], local_size: int) -> list[list[int]]:
    """Per bucket (its tensors' element counts, in bucket order), each tensor's owner:
    the local rank whose share it is. Largest first to the least loaded (ties: the
    least loaded over the buckets before, then the lowest rank).

    Example:
        >>> owners([[100, 60, 50], [10]], 2)
        [[0, 1, 1], [0]]
    """
    total = [0] * local_size
    out = []
    for sizes in buckets:
        load = [0] * local_size
        owner = [0] * len(sizes)
        for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):  # stable: ties keep order
            j = min(range(local_size), key=lambda j: (load[j], total[j], j))
            owner[i] = j
            load[j] += sizes[i]
            total[j] += sizes[i]
        out.append(owner)
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
