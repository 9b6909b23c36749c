"""How exact `orthogonalize_` is, both methods, on ResNet-50's and GPT-2's factor shapes.

For each shape and condition number (singular values spaced evenly on a log scale
from 1 down to 1/condition, random singular vectors, float32), the largest
|Q̂ᵀQ̂ − I| over the columns kept, the relative residual ||Q̂Q̂ᵀA − A|| / ||A||, and how
many columns were kept, for Householder and CholeskyQR at the default floor and at
full rank's (`dependence_floor(..., complete=True)`). Prints a markdown table.

    python scripts/gpu/orthogonality.py [--seed 0]
"""

from __future__ import annotations

import argparse

import torch

from horovod_powersgd import linalg

# (name, k, n, r): factor batches as PowerSGD orthogonalises them
SHAPES = [
    ("ResNet-50 Q side, 4608 x 4", 8, 4608, 4),
    ("ResNet-50 P side, 512 x 4", 8, 512, 4),
    ("GPT-2 MLP, 3072 x 32", 4, 3072, 32),
    ("GPT-2 tied embedding, 50257 x 32", 1, 50257, 32),
    ("small full rank, 27 x 8", 4, 27, 8),
]
CONDITIONS = (1e0, 1e2, 1e4, 1e6, 1e8)


def conditioned(k: int, n: int, r: int, condition: float) -> torch.Tensor:
    """k float32 n x r matrices with singular values from 1 down to 1/condition."""
    u, _ = torch.linalg.qr(torch.randn(k, n, r, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(k, r, r, dtype=torch.float64))
    s = torch.logspace(0, -torch.log10(torch.tensor(condition)).item(), r, dtype=torch.float64)
    return ((u * s) @ v.mT).float()


def quality(q: torch.Tensor, a: torch.Tensor) -> tuple[float, float, int]:
    """(largest |Q̂ᵀQ̂ − I| over kept columns, largest relative residual, columns kept)."""
    q, a = q.double(), a.double()
    gram = q.mT @ q
    kept = torch.diagonal(gram, dim1=1, dim2=2) > 0.5
    orthogonality = (gram - torch.diag_embed(kept.double())).abs().amax().item()
    residual = (q @ (q.mT @ a) - a).norm(dim=(1, 2)) / a.norm(dim=(1, 2))
    return orthogonality, residual.amax().item(), int(kept.sum())


def rows(seed: int = 0):
    """One row per shape, condition and method: the `quality` at both floors."""
    torch.manual_seed(seed)
    before = linalg.METHOD
    try:
        for name, k, n, r in SHAPES:
            for condition in CONDITIONS:
                a = conditioned(k, n, r, condition)
                for method in linalg.METHODS:
                    linalg.METHOD = method
                    floors = (None, linalg.dependence_floor(a.dtype, complete=True))
                    yield (
                        name,
                        condition,
                        method,
                        [quality(linalg.orthogonalize_(a.clone(), floor), a) for floor in floors],
                    )
    finally:
        linalg.METHOD = before


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(
        "| factors (k of them) | condition | method | orthogonality | residual | kept "
        "| full rank: orthogonality | residual | kept |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, condition, method, results in rows(args.seed):
        cells = " | ".join(f"{o:.1e} | {r:.1e} | {kept}" for o, r, kept in results)
        print(f"| {name} | {condition:.0e} | {method} | {cells} |")


if __name__ == "__main__":
    main()
