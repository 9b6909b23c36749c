"""Sparse gradients (`nn.Embedding(sparse=True)`): one decision for every rank.

Which parameters have sparse gradients is agreed by all ranks: a parameter
whose gradient arrived sparse on any rank, at a step or before, is sparse on
every rank from then on, and its aggregate goes back sparse (`to_sparse()`, as
Horovod does, so `torch.optim.SparseAdam` works) also on a rank that did not use
it, so every rank hands the wrapped optimizer the same gradient. With
`sparse_as_dense` those gradients travel dense in their buckets (compressed
like the others); without it a parameter's first sparse gradient travels dense,
and once agreed it leaves PowerSGD and is all-gathered as indices and values,
as Horovod does (`Comm.sparse_allreduce_async`).

No Horovod here: the optimizer hands in its `comm.Comm`, and a callback that
takes parameters out of PowerSGD.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class SparseGradients:
    """The optimizer's sparse parameters and this step's sparse gradients.

    Args:
        params: the parameters that get gradients, in the optimizer's order.
        names: parameter -> its name.
        comm: the optimizer's collectives.
        as_dense: `sparse_as_dense`.
        leave_powersgd: called alike on every rank with parameters that from the
            next step on are all-gathered (they leave PowerSGD).
    """

    def __init__(self, params, names, comm, as_dense: bool, leave_powersgd: Callable):
        self.params, self.names, self.comm = params, names, comm
        self.as_dense = as_dense
        self.leave_powersgd = leave_powersgd
        self.sparse: set[torch.Tensor] = set()  # agreed by every rank (`settle`)
        self.checks = True  # the next step agrees on them (the first step does)
        self.gathered: set[torch.Tensor] = set()  # all-gathered (without sparse_as_dense)
        # --- this step's -----------------------------------------------------------------
        self.was_sparse: set[torch.Tensor] = set()  # densified here
        self.gathers: dict = {}  # parameter -> wait for its aggregate

    def ready(self, p: torch.Tensor) -> None:
        """A gradient that is or may be sparse: all-gathered, or made dense for its bucket."""
        if p in self.gathered:  # agreed sparse on every rank, without sparse_as_dense
            grad = p.grad
            if grad is None:  # unused here: no rows
                grad = torch.sparse_coo_tensor(
                    torch.empty(1, 0, dtype=torch.long, device=p.device),
                    torch.empty(0, *p.shape[1:], dtype=p.dtype, device=p.device),
                    p.shape, check_invariants=False,
                )  # fmt: skip
            elif not grad.is_sparse:
                grad = grad.to_sparse(1)  # rows, as an embedding's
            self.gathers[p] = self.comm.sparse_allreduce_async(grad, f"sparse.{self.names[p]}")
        elif p.grad is not None and p.grad.is_sparse:
            # sparse_as_dense, or the first sparse gradient of p (agreed after this step):
            # reduced dense in its bucket, with the other ranks' (maybe zero) gradients.
            self.was_sparse.add(p)
            p.grad = p.grad.to_dense()

    def settle(self) -> None:
        """Agree which gradients are sparse, and hand those back sparse on every rank.

        One small all-reduce of a flag per parameter, after the step's other
        collectives: at the first step, then at every step while any parameter
        is sparse or `sparse_as_dense` is set (a dense model pays it once).
        """
        for p, aggregate in self.gathers.items():
            p.grad = aggregate()
        self.gathers.clear()
        seen = [int(p in self.was_sparse) for p in self.params]
        seen = self.comm.allreduce_sum(torch.tensor(seen, dtype=torch.int32), "sparse")
        self.sparse.update(p for p, count in zip(self.params, seen.tolist()) if count)
        self.checks = self.as_dense or bool(self.sparse)
        self.was_sparse.clear()
        for p in self.sparse:
            if p.grad is not None and not p.grad.is_sparse:
                # As Horovod's sparse_as_dense; else as the all-gathered ones will be (rows).
                p.grad = p.grad.to_sparse() if self.as_dense else p.grad.to_sparse(1)
        if not self.as_dense:
            self.gather(self.sparse)

    def gather(self, params) -> None:
        """From the next step on, all-gather `params`' gradients (called alike on every rank).

        They leave PowerSGD: their error buffers and memories are dropped, the
        other matrices of their buckets keep theirs.
        """
        new = [p for p in params if p not in self.gathered]
        if not new:
            return
        self.sparse.update(new)
        self.gathered.update(new)
        self.leave_powersgd(new)

    def take(self, names) -> None:
        """The sparse parameters of a saved or another rank's state, by name."""
        names = set(names)
        params = [p for p in self.params if self.names[p] in names]
        self.sparse.update(params)
        self.checks = self.checks or bool(params)
        if not self.as_dense:
            self.gather(params)

    def leaving(self, names) -> set[str]:
        """Which of a saved state's sparse parameters `take` would take out of PowerSGD."""
        return set() if self.as_dense else set(names)

    def sparse_names(self) -> list[str]:
        return sorted(self.names[p] for p in self.sparse)

    def forget_step(self) -> None:
        """A step cut short (a load): its gradients are not handed back."""
        self.was_sparse.clear()
        self.gathers.clear()
