"""An order of the rounds=2 step kept for comparison only: the bench's "powersgd-qbyq".

Until commit 5a4e37f a rounds=2 step sent each bucket's Q alone, as soon as its P was
back (seen by a poll in a later hook during backward, or waited for after it), and
waited for the Q's one by one: a wait and a lone Horovod request per bucket. The
library's `Reducer.finish` now waits for every P, projects them all at once and sends
every Q in one grouped all-reduce: two dependent rounds after backward, whatever the
number of buckets. This keeps the old order of collectives on
today's math, so the paired bench can time the two in one job
(`--plan '[["powersgd",2],["powersgd-qbyq",2]]'`). The factors are the same either way;
only when they travel, and how many requests carry them, differ. Not for training.
"""

from __future__ import annotations

import torch

from ..comm import poll
from ..reducer import Reducer


class QByQReducer(Reducer):
    """`Reducer` with rounds=2's Q round bucket by bucket, as each P comes back."""

    def ready(self, p: torch.Tensor) -> None:
        super().ready(p)
        if self.compressing and self.two_rounds:
            for b in self.launched:  # every bucket whose P is back: its Q leaves now
                if b.factor_count and len(b.handles) == 1 and poll(b.handles[0]):
                    self._second_round(b)

    def _second_round(self, bucket) -> None:
        first = self.comm.wait(bucket.handles[0])
        bucket.received = first[bucket.factor_count :]
        ps = first[: bucket.factor_count]
        qs = self.compressor.project_all({bucket.index: ps})[bucket.index]
        bucket.handles.append(self.comm.allreduce_async(qs, f"b{bucket.index}.q"))
        self.compressor.update_error(bucket.index)  # while its Q round runs

    def finish(self) -> None:
        if not (self.compressing and self.two_rounds):
            return super().finish()
        for b in self.sending:
            if b.factor_count and len(b.handles) == 1:
                self._second_round(b)
        factors, copies = {}, []
        for b in self.sending:
            if b.factor_count:
                factors[b.index] = self.comm.wait(b.handles[-1])
            else:
                b.received = self.comm.wait(b.handles[0])
            self._receive_uncompressed(b, b.received, copies)
        if copies:
            torch._foreach_copy_([t for t, _ in copies], [r for _, r in copies])
        self._decompress(factors)


def use_q_by_q(optimizer) -> None:
    """Make a flat, fixed-rank `horovod_powersgd.DistributedOptimizer` send Q by Q."""
    state = optimizer.powersgd_state
    if state.hierarchy is not None or type(state.reducer) is not Reducer:
        raise ValueError("powersgd-qbyq: the flat layout's Reducer only (no hierarchical)")
    state.reducer.__class__ = QByQReducer
