"""Hierarchical PowerSGD: exact inside a node, compressed between nodes, the work shared.

On a cluster of nodes of L workers each (`hierarchical=True`), every bucket of a
compressed step travels in four stages (docs/hierarchical.md):

    stage                 process set         what                               link
    1 reduce-scatter      the node (L)        the bucket, exact; local rank j     in the node
                                              gets its share's node average
    2 P (and the share's  local rank j's      M = share + e; P = M·Q̂ summed       between nodes
      uncompressed)       peers (one a node)
    3 Q (rounds=2)        the same            P̂ = orth(P); Q = Mᵀ·P̂ averaged      between nodes
    4 all-gather          the node            the decompressed shares, so every   in the node
                                              worker steps on the same gradient

A bucket's place in a step is its `NodeBucket.stage`: a `Stage`, WAITING, then
NODE_REDUCE, P_ROUND, Q_ROUND (rounds=2) and NODE_GATHER (stages 1-4) while each
collective is in flight, DONE once `p.grad` holds the aggregate.

A share is about 1/L of each bucket's tensors, balanced by size (largest first
to the least loaded local rank), the same on every node. A tensor too large to
be one share (a tied embedding's bucket) is split by rows (a wide matrix by
columns): every share holds a block and compresses it as a matrix of its own
(`shares.owners`, `shares.split_of`). Local rank j holds the error buffers and
memories of its share only: error feedback on the node's average, and 1/L of
flat PowerSGD's compression work. Its uncompressed tensors ride with its P,
exactly. Warm-up steps are plain Horovod over all ranks.

`decide` turns the setting into a `Hierarchy` (or None: flat), one decision for
all ranks from one all-gather of what Horovod says of each rank's node.
`HierarchicalReducer` is the reducer's variant for it, chosen at construction;
its buckets are `NodeBucket`s, which hold their node layout and their `Stage`.
"""

from __future__ import annotations

import enum
import warnings

import torch

from . import comm as hvd_comm
from . import shares
from .config import COMM_DTYPES
from .reducer import Bucket, Reducer

_ENABLE = (
    "set HOROVOD_DYNAMIC_PROCESS_SETS=1 for every worker "
    '(mpirun -x, or hvd.init(process_sets="dynamic"))'
)


class Hierarchy:
    """Where this rank sits: its node's ranks, its peers on the other nodes, its share.

    Args:
        rows: every rank's `comm.node_layout()`, in global rank order (uniform).
        rank: this rank's global rank.
        comm: the optimizer's `comm.Comm` (global process set).
    """

    def __init__(self, rows: list[list[int]], rank: int, comm):
        self.local_rank, self.local_size, self.cross_rank, self.cross_size = rows[rank][:4]
        # Nodes by cross rank, each its ranks by local rank.
        grid = {(r[2], r[0]): g for g, r in enumerate(rows)}
        nodes = [[grid[(c, j)] for j in range(self.local_size)] for c in range(self.cross_size)]
        peers = [[grid[(c, j)] for c in range(self.cross_size)] for j in range(self.local_size)]
        sets = hvd_comm.process_sets(nodes + peers)  # every rank adds every set, in order
        node_set, cross_set = sets[self.cross_rank], sets[len(nodes) + self.local_rank]
        self.nodes, self.peers = nodes, peers
        self.splits = False  # whether `owners` split a tensor by rows or columns
        self.share_of = [r[0] for r in rows]  # each rank's share (its local rank)
        self.node_of = [r[2] for r in rows]
        node_op = hvd_comm.Sum if comm.op == hvd_comm.Sum else hvd_comm.Average
        self.node = hvd_comm.Comm(node_set, node_op)
        self.cross = hvd_comm.Comm(cross_set, comm.op, comm.compression, comm.predivide)
        self.cross.tally = comm  # what crosses the node link is what the optimizer sent

    @property
    def key(self) -> list:
        """The share a state belongs to: [local rank, workers per node], and "split" where
        a tensor is split (saved with it: a state of another layout, such as one saved
        before tensors were split, does not fit and starts fresh, with a warning)."""
        return [self.local_rank, self.local_size, *(["split"] if self.splits else [])]

    def compressed(self, reducer: Reducer, config, ranks: dict | None = None) -> list[str]:
        """Every share's compressed parameters, in bucket order (the same on every rank),
        at `config`'s rank or at each bucket's of `ranks` (rank="auto"'s plan)."""

        def compressed(p, rank) -> bool:  # a split tensor: where a share's block is
            kind = reducer.owner[reducer.names[p]]
            parts = [block_of(p, j, self.local_size, kind) for j in range(self.local_size)] if (
                kind < 0) else [p]  # fmt: skip
            return any(config.compresses(part.shape, rank) for part in parts)

        return [
            reducer.names[p] for b in reducer.buckets for p in b.params
            if p not in reducer.skip and compressed(p, (ranks or {}).get(b.index))
        ]  # fmt: skip

    def root_for(self, root_rank: int) -> int:
        """The peer of this rank on `root_rank`'s node: the root of this share's state."""
        return self.peers[self.local_rank][self.node_of[root_rank]]

    def owners(self, buckets: list[Bucket], names: dict) -> dict[str, int]:
        """name -> the local rank whose share it is, or `shares.SPLIT` / `SPLIT_COLUMNS` (a
        block of its rows / columns in every share): `shares.owners`, per bucket."""
        sizes = [[p.numel() for p in b.params] for b in buckets]
        shapes = [[tuple(p.shape) for p in b.params] for b in buckets]
        split = shares.owners(sizes, self.local_size, shapes)
        self.splits = any(j < 0 for owner in split for j in owner)
        return {names[p]: j for b, owner in zip(buckets, split) for p, j in zip(b.params, owner)}

    def mine(self, params: list, owner: dict, names: dict) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of this share's parameters: the whole tensor, or this share's
        block of a split one's rows or columns (what its compressor holds)."""
        out = []
        for p in params:
            j = owner[names[p]]
            if j < 0:  # split: this share's block
                out.append((names[p], block_of(p.detach(), self.local_rank, self.local_size, j)))
            elif j == self.local_rank:
                out.append((names[p], p))
        return out


def cut(p: torch.Tensor, kind: int, local_size: int) -> list[tuple[int, int, int]]:
    """A split tensor's blocks (`shares.SPLIT` by rows, `SPLIT_COLUMNS` by columns), as
    (dimension, start, length) per share: `tensor.narrow`'s arguments."""
    dim = 0 if kind == shares.SPLIT else 1  # a split tensor has a dimension at least
    return [(dim, start, stop - start) for start, stop in shares.blocks(p.shape[dim], local_size)]


def block_of(tensor: torch.Tensor, share: int, local_size: int, kind: int) -> torch.Tensor:
    """Share `share`'s block of a split tensor (a view)."""
    return tensor.narrow(*cut(tensor, kind, local_size)[share])


def check(setting, process_set, elastic: bool) -> bool:
    """Whether `hierarchical` may be on with these settings; True where it cannot raises
    (before any collective, on every rank alike: the same arguments everywhere)."""
    why = None
    if elastic:
        why = "elastic Horovod changes the nodes while training; shares are fixed at construction"
    elif process_set.process_set_id != 0:
        why = "it needs the global process set (nodes are Horovod's local and cross ranks)"
    if why is not None and setting is True:
        raise ValueError(f"hierarchical=True: {why}; use hierarchical=False")
    return why is None


def decide(setting, comm, *, elastic: bool) -> Hierarchy | None:
    """The `hierarchical` setting, for this job: a `Hierarchy`, or None (flat).

    True raises (on every rank alike) where it cannot work; "auto" is possible where
    it can and the job has several nodes of several workers each (with rank="auto"
    the tuner then chooses it or flat from its measurements: state.py).
    """
    if setting is False or not check(setting, comm.process_set, elastic):
        return None
    asked = setting is True
    if comm.size == 1:
        return None
    rows = comm.allgather(torch.tensor([hvd_comm.node_layout()]), "nodes").tolist()
    sizes = {r[1] for r in rows}
    uniform = len(sizes) == 1 and len({(r[2], r[0]) for r in rows}) == len(rows)
    uniform = uniform and all(r[3] * r[1] == len(rows) for r in rows)
    if not uniform:
        if asked:
            per_node = {}
            for r in rows:
                per_node[r[2]] = per_node.get(r[2], 0) + 1
            raise ValueError(
                "hierarchical=True needs the same number of workers on every node; this job "
                f"has {sorted(per_node.values())} (use hierarchical=False)"
            )
        return None
    local_size, cross_size = rows[0][1], rows[0][3]
    if local_size == 1 or cross_size == 1:
        if asked:
            what = "one worker per node: nothing to share" if local_size == 1 else (
                "one node: no link between nodes to save")  # fmt: skip
            warnings.warn(f"hierarchical=True on {what}; PowerSGD runs flat", stacklevel=4)
        return None
    if not all(r[4] for r in rows):
        message = f"hierarchical PowerSGD needs process sets of its own: {_ENABLE}"
        if asked:
            raise ValueError(message)
        warnings.warn(message + "; PowerSGD runs flat", stacklevel=4)
        return None
    return Hierarchy(rows, comm.set_rank, comm)


class _Pack:
    """One dtype's tensors of a bucket, as the node's collectives carry them.

    Scattered (`build(True)`): an (L, longest share) tensor whose row j is local
    rank j's share, zero-padded; reduce-scattered in stage 1, all-gathered in 4.
    A tensor too large to be one share is split: a block of its rows (or of a
    wide matrix's columns, copied in and out strided) in every row
    (`shares.owners`), the pieces of it that each share compresses alone.
    Where the shares stay uneven (a large tensor that cannot be split),
    the padding could make the rows L times the bucket; such a bucket is reduced
    whole (`build(False)`):
    the bucket as one flat tensor, all-reduced (averaged) in stage 1 and, with
    every share but this worker's zeroed, summed in stage 4. Scattered moves
    (L-1)·(longest share) per worker and stage, reduced 2(L-1)/L of the bucket:
    `padded_work` compares them.
    """

    def __init__(self, params: list, owner: dict, names: dict, local_size: int, me: int):
        self.params, self.local_size, self.me = params, local_size, me
        offsets, flat = [0] * local_size, 0
        # Per piece (a tensor, or a block of a split one, `shares.SPLIT` / `SPLIT_COLUMNS`):
        # (param, its `cut` (None: all of it), owner, offset in the owner's row, in the
        # flat bucket, numel, shape).
        self.where = []
        for p in params:
            j = owner[names[p]]
            parts = [(None, j)] if j >= 0 else list(zip(cut(p, j, local_size), range(local_size)))
            for piece, k in parts:
                view = p if piece is None else p.narrow(*piece)
                self.where.append((p, piece, k, offsets[k], flat, view.numel(), view.shape))
                offsets[k] += view.numel()
                flat += view.numel()
        self.sizes = [w[5] for w in self.where]
        self.owner = [w[2] for w in self.where]
        self.length, self.total = max(1, *offsets), max(1, flat)
        dtype = params[0].dtype
        self.dtype = dtype if dtype in COMM_DTYPES else torch.float32
        self.device = params[0].device

    def padded_work(self) -> tuple[int, int]:
        """(elements a worker sends scattered, ... reduced whole), per node stage, times L."""
        return shares.padded_work(self.sizes, self.owner, self.local_size)

    def build(self, scattered: bool) -> None:
        self.scattered = scattered
        shape = (self.local_size, self.length) if scattered else (self.total,)
        self.buffer = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.send_views = [v for _, v in self.views(self.buffer)]
        if not scattered:  # 1 where this worker's share lies: zeroes the others' in stage 4
            self.mask = torch.zeros(self.total, dtype=self.dtype, device=self.device)
            for _, view in self.views(self.mask, self.me):
                view.fill_(1)

    def grads(self) -> list[torch.Tensor]:
        """Each piece's part of its `p.grad`, in `views(result)`'s order (a view; a
        block of columns, strided)."""
        return [p.grad if piece is None else p.grad.narrow(*piece) for p, piece, *_ in self.where]

    def views(self, result: torch.Tensor, share: int | None = None) -> list:
        """(param, the view of its piece) in `result`: the whole bucket's pieces (share
        None) or one share's (a split tensor's block there). Scattered: (L, longest) for
        the bucket, (longest,) for a share."""
        out = []
        for p, _, j, row_offset, flat_offset, n, shape in self.where:
            if share is not None and j != share:
                continue
            if not self.scattered:
                out.append((p, result[flat_offset : flat_offset + n].view(shape)))
            elif share is None:
                out.append((p, result[j, row_offset : row_offset + n].view(shape)))
            else:
                out.append((p, result[row_offset : row_offset + n].view(shape)))
        return out


class Stage(enum.IntEnum):
    """Where a bucket of a compressed step is: 1-4 are the stages of the module
    docstring, each while its collective is in flight."""

    WAITING = 0  # its gradients are not all final yet (and in warm-up steps)
    NODE_REDUCE = 1  # the node's reduce-scatter (or all-reduce, reduced whole)
    P_ROUND = 2  # P (rounds=1: the factor) and the share's uncompressed, between nodes
    Q_ROUND = 3  # Q between nodes (rounds=2)
    NODE_GATHER = 4  # the node's all-gather (or sum, reduced whole)
    DONE = 5  # every p.grad holds the bucket's aggregate


IN_FLIGHT = (Stage.NODE_REDUCE, Stage.P_ROUND, Stage.Q_ROUND, Stage.NODE_GATHER)


class NodeBucket(Bucket):
    """A bucket of the hierarchical reducer: the flat one's fields, its layout in the
    node (`HierarchicalReducer._layout`), and how far it is in a compressed step."""

    def __init__(self, index: int, params: list[torch.Tensor]):
        self.packs: list[_Pack] = []  # one per dtype of its dense tensors
        self.scattered = False  # reduce-scattered in the node, or reduced whole
        self.shared_plain: list[torch.Tensor] = []  # this share's uncompressed tensors
        # Stage 1's result (this worker's row of each pack), and the views of this share's
        # tensors in it (param -> view): set in stage 2, read in stage 4, let go in 5.
        self.sections = self.share_views = None
        super().__init__(index, params)

    def clear(self) -> None:
        super().clear()
        self.stage = Stage.WAITING


class HierarchicalReducer(Reducer):
    """`Reducer` for hierarchical PowerSGD: a compressed step's buckets take the four
    stages of the module docstring (`Stage`); warm-up steps are the flat reducer's
    (`super()`'s: plain Horovod over all ranks, the same buckets)."""

    def __init__(self, buckets, names, compressor, comm, hierarchy: Hierarchy, owner: dict):
        self.hierarchy, self.owner = hierarchy, owner
        buckets = [NodeBucket(b.index, b.params) for b in buckets]
        super().__init__(buckets, names, compressor, comm)

    def refresh(self) -> None:
        super().refresh()
        self._layout()

    def _layout(self) -> None:
        """Each bucket's packs, scattered or reduced whole (`shares.scatters`)."""
        me, size = self.hierarchy.local_rank, self.hierarchy.local_size
        for b in self.buckets:
            by_dtype = {}
            for p in b.dense:
                by_dtype.setdefault(p.dtype, []).append(p)
            b.packs = [_Pack(ps, self.owner, self.names, size, me) for ps in by_dtype.values()]
            b.scattered = shares.scatters([(k.sizes, k.owner) for k in b.packs], size)
            for pack in b.packs:
                pack.build(b.scattered)
            ours = (me, shares.SPLIT, shares.SPLIT_COLUMNS)  # split: this share's block
            b.shared_plain = [p for p in b.dense if self.owner[self.names[p]] in ours]
            b.shared_plain = [p for p in b.shared_plain if p not in self._compressed]
            b.stage = Stage.WAITING

    def begin(self, done: int) -> None:
        self.in_step, self.compressing = True, done >= 0
        if self.compressing:  # P and Q are summed by one worker per node
            self.compressor.begin_step(self.hierarchy.cross_size, done)

    def ready(self, p: torch.Tensor) -> None:
        if not self.compressing:
            return super().ready(p)
        bucket = self._bucket_of[p]
        self.done.add(p)
        bucket.ready += 1
        if bucket.ready == len(bucket.params) and bucket.dense:
            self._scatter(bucket)
        for b in self.launched:
            self._advance(b, block=False)

    def finish(self) -> None:
        """Four dependent rounds at most after backward, whatever the number of buckets:
        in wave k every bucket at stage k waits for it and starts its next. A rank waits
        in wave k only for what every rank of its set started by wave k-1 (or during
        backward): a share with nothing of a bucket starts its node stage 4 early, and
        waits for it in wave 4 only, not while its node's others are still in 2 or 3
        (waited at once, it could wait in a circle with them)."""
        if not self.compressing:
            return super().finish()
        for stage in IN_FLIGHT:
            for bucket in self.sending:
                if bucket.stage == stage:
                    self._advance(bucket, block=True, once=True)

    def _scatter(self, bucket: NodeBucket) -> None:
        """Stage 1: the bucket's gradients, reduce-scattered inside the node."""
        for p in bucket.dense:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for pack in bucket.packs:
            torch._foreach_copy_(pack.send_views, pack.grads())
        bucket.stage = Stage.NODE_REDUCE
        buffers, node = [pack.buffer for pack in bucket.packs], self.hierarchy.node
        if bucket.scattered:
            handle = node.reducescatter_async(buffers, f"b{bucket.index}.rs")
        else:  # in place: the buffers hold the node's average
            handle = node.allreduce_async(buffers, f"b{bucket.index}.ar")
        bucket.handles = [handle]
        self.launched.append(bucket)

    def _advance(self, bucket: NodeBucket, block: bool, once: bool = False) -> None:
        """Take `bucket` through its stages as far as its collectives are back (`once`:
        one stage, waiting for it if `block`)."""
        while bucket.stage in IN_FLIGHT:
            handle = bucket.handles[-1]
            if not block and not self.comm.poll(handle):
                return
            result = self.comm.wait(handle)
            if bucket.stage == Stage.NODE_REDUCE:  # scattered: this worker's (1, longest) row
                self._compress_share(bucket, [t.view(-1) for t in result])
            elif bucket.stage == Stage.P_ROUND and self.two_rounds and bucket.factor_count:
                self._send_q(bucket, result)
            elif bucket.stage in (Stage.P_ROUND, Stage.Q_ROUND):
                if bucket.stage == Stage.P_ROUND:  # one round: the factors lead, then the rest
                    bucket.received = result[bucket.factor_count :]
                    result = result[: bucket.factor_count]
                self._gather(bucket, result)
            else:
                self._unpack(bucket, result)
            if once:
                return

    def _compress_share(self, bucket: NodeBucket, sections: list[torch.Tensor]) -> None:
        """Stage 2: compress this worker's share of the node's average and send P (or the
        rounds=1 factor) with the share's uncompressed tensors to its peers."""
        bucket.sections = sections
        share = self.hierarchy.local_rank
        mine = {
            p: v for pack, rows in zip(bucket.packs, sections) for p, v in pack.views(rows, share)
        }
        bucket.share_views = mine
        self.compressor.compress_bucket(
            bucket.index, {self.names[p]: mine[p] for p in bucket.compressed}
        )
        if self.monitor is not None and bucket.compressed:
            self.monitor.bucket_ready(
                bucket.index, bucket.names, [mine[p] for p in bucket.compressed]
            )
        cross = self.hierarchy.cross
        bucket.sent = bucket.shared_plain
        bucket.packed = cross.pack([mine[p] for p in bucket.shared_plain], self.comm_dtype)
        factors = self.compressor.send_buffers(bucket.index)
        bucket.factor_count = len(factors)
        tensors = factors + bucket.packed.tensors
        if not tensors:  # nothing of this bucket is this share's
            bucket.received = []
            return self._gather(bucket, [])
        bucket.handles.append(cross.allreduce_async(tensors, f"b{bucket.index}.r1"))
        bucket.stage = Stage.P_ROUND

    def _send_q(self, bucket: NodeBucket, outputs) -> None:
        """Stage 3 (rounds=2): `outputs` are the share's summed P factors, then its
        uncompressed tensors. Q = Mᵀ·orth(P) leaves for the peers; then the error."""
        bucket.received = outputs[bucket.factor_count :]  # into the share in stage 4
        q_buffers = self.compressor.project(outputs[: bucket.factor_count], bucket.index)
        cross = self.hierarchy.cross
        bucket.handles.append(cross.allreduce_async(q_buffers, f"b{bucket.index}.r2"))
        self.compressor.update_error(bucket.index)
        bucket.stage = Stage.Q_ROUND

    def _gather(self, bucket: NodeBucket, factors) -> None:
        """Stage 4: the share's aggregate into its section; the sections all-gathered."""
        if bucket.packed is not None:
            bucket.packed.write(bucket.received, [bucket.share_views[p] for p in bucket.sent])
        bucket.sent, bucket.packed = [], None
        if bucket.factor_count:
            out = {self.names[p]: bucket.share_views[p] for p in bucket.compressed}
            self.compressor.decompress(list(factors), out=out, bucket=bucket.index)
        node = self.hierarchy.node
        if bucket.scattered:
            rows = [s.view(1, -1) for s in bucket.sections]
            handle = node.allgather_async(rows, f"b{bucket.index}.ag")
        else:  # this worker's share, zeros elsewhere, summed over the node
            sections = [s.mul_(pack.mask) for s, pack in zip(bucket.sections, bucket.packs)]
            handle = node.sum_async(sections, f"b{bucket.index}.sum")
        bucket.handles.append(handle)
        bucket.stage = Stage.NODE_GATHER

    def _unpack(self, bucket: NodeBucket, gathered) -> None:
        """Every worker's `p.grad` := the bucket's aggregate, from the gathered sections."""
        for pack, rows in zip(bucket.packs, gathered):
            torch._foreach_copy_(pack.grads(), [v for _, v in pack.views(rows)])
        bucket.stage = Stage.DONE
        bucket.sections = bucket.share_views = None
