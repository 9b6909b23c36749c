"""hierarchy.py without Horovod running: the shares, the packed layout, the decision."""

import types

import pytest
import torch

from horovod_powersgd import comm as hvd_comm
from horovod_powersgd import hierarchy, shares
from horovod_powersgd.reducer import make_buckets


def owners_of(params, local_size):
    names = {p: f"p{i}" for i, p in enumerate(params)}
    fake = types.SimpleNamespace(local_size=local_size)
    buckets = make_buckets(params)
    return hierarchy.Hierarchy.owners(fake, buckets, names), names, buckets


def test_shares_split_each_bucket_by_size_the_same_way_every_time():
    params = [torch.zeros(n, 64) for n in (64, 64, 32, 32, 16, 8, 8)] + [torch.zeros(64)]
    owner, names, _ = owners_of(params, 2)
    again, _, _ = owners_of(params, 2)
    assert owner == again  # a function of the shapes alone: equal on every rank
    load = [0, 0]
    for p in params:
        load[owner[names[p]]] += p.numel()
    # Largest first to the least loaded: the two shares within the smallest tensor.
    assert abs(load[0] - load[1]) <= 8 * 64, load
    assert set(owner.values()) == {0, 1}


def test_more_workers_per_node_than_tensors_leaves_some_shares_empty():
    # The large tensor has fewer rows than workers and more than two dimensions: it cannot
    # be split, by rows or by columns.
    params = [torch.zeros(2, 16, 32), torch.zeros(32)]
    owner, _, _ = owners_of(params, 4)
    assert sorted(owner.values()) == [0, 1]  # one tensor each to the first two


def test_a_tensor_too_large_for_one_share_is_split_by_rows_across_the_node():
    """A bucket of one large tensor (a tied embedding) would be one worker's work while
    the others wait: it is split, a block of its rows to every share, and the rest of
    the bucket balanced around it; the same split on every rank (shapes alone)."""
    params = [torch.zeros(7, 10), torch.zeros(10)]
    with pytest.MonkeyPatch.context() as patch:  # a tiny matrix stands in for a large one
        patch.setattr(shares, "SPLIT_COST", 4.0)
        owner, names, buckets = owners_of(params, 3)
        # The share's key, saved with its state, says so: a state of the layout before
        # (the tensor one share's) does not fit and starts fresh, with a warning.
        node = types.SimpleNamespace(local_rank=1, local_size=3, splits=False)
        assert hierarchy.Hierarchy.key.fget(node) == [1, 3]
        hierarchy.Hierarchy.owners(node, buckets, names)
        assert hierarchy.Hierarchy.key.fget(node) == [1, 3, "split"]
    assert owner == {"p0": shares.SPLIT, "p1": 1}  # to the least loaded after it
    assert shares.blocks(7, 3) == [(0, 3), (3, 5), (5, 7)]
    # Not a matrix whose extra Qs would cost more than SPLIT_COST of its factors.
    assert owners_of(params, 3)[0] == {"p0": 0, "p1": 1}
    me = types.SimpleNamespace(local_rank=1, local_size=3)
    mine = hierarchy.Hierarchy.mine(me, params, owner, names)
    # Rows 3-4 of p0, what it compresses, and p1 whole.
    assert [(n, t.shape) for n, t in mine] == [("p0", (2, 10)), ("p1", (10,))]
    assert mine[0][1].data_ptr() == params[0][3].data_ptr()
    # The node's pack: each share's block in its row, balanced (30, 20+10, 20); the bucket
    # scattered, no longer reduced whole; a block's view has the block's shape.
    pack = hierarchy._Pack(params, owner, names, 3, me=1)
    assert pack.sizes == [30, 20, 20, 10] and pack.owner == [0, 1, 2, 1]
    scattered, whole = pack.padded_work()
    assert scattered < whole
    pack.build(scattered=True)
    assert pack.buffer.shape == (3, 30)
    grads = [torch.arange(70.0).view(7, 10), torch.arange(10.0) + 100]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    torch._foreach_copy_(pack.send_views, pack.grads())
    share = dict(pack.views(pack.buffer[1], share=1))
    assert torch.equal(share[params[0]], grads[0][3:5])
    assert torch.equal(pack.buffer[1, 20:], grads[1])
    # Back into p.grad from the gathered rows, every block in its place.
    for p in params:
        p.grad.zero_()
    torch._foreach_copy_(pack.grads(), [v for _, v in pack.views(pack.buffer)])
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))
    # Reduced whole (the padding test's other branch): the blocks tile the flat bucket.
    pack.build(scattered=False)
    assert torch.equal(pack.mask, torch.cat([torch.zeros(30), torch.ones(20), torch.zeros(20),
                                             torch.ones(10)]))  # fmt: skip


def test_a_pack_lays_out_each_share_in_its_row_padded_to_the_longest():
    params = [torch.zeros(3, 2), torch.zeros(5), torch.zeros(2, 2)]
    names = {p: str(i) for i, p in enumerate(params)}
    owner = {"0": 0, "1": 1, "2": 0}
    pack = hierarchy._Pack(params, owner, names, 2, me=0)
    pack.build(scattered=True)
    assert pack.buffer.shape == (2, 10)  # share 0: 6 + 4, share 1: 5 (padded)
    grads = [torch.arange(p.numel(), dtype=torch.float32).view(p.shape) + 10 * i
             for i, p in enumerate(params)]  # fmt: skip
    torch._foreach_copy_(pack.send_views, grads)
    # Row j holds share j's tensors; the padding stays zero.
    assert torch.equal(pack.buffer[1, 5:], torch.zeros(5))
    mine = dict(pack.views(pack.buffer[0], share=0))
    assert set(mine) == {params[0], params[2]}
    assert torch.equal(mine[params[2]], grads[2])
    everything = dict(pack.views(pack.buffer))
    assert all(torch.equal(everything[p], g) for p, g in zip(params, grads))


def test_a_bucket_of_one_large_tensor_is_reduced_whole_not_padded():
    """Padding one 1000-element share to 4 rows would send 4x the bucket; reduced
    whole it is one flat tensor, and the mask keeps this worker's share only."""
    params = [torch.zeros(40, 25), torch.zeros(7)]
    names = {p: str(i) for i, p in enumerate(params)}
    pack = hierarchy._Pack(params, {"0": 0, "1": 1}, names, 4, me=1)
    scattered, whole = pack.padded_work()
    assert scattered > whole  # 4·3·1000 > 2·3·1007
    pack.build(scattered=False)
    assert pack.buffer.shape == (1007,)
    assert torch.equal(pack.mask, torch.cat([torch.zeros(1000), torch.ones(7)]))
    mine = dict(pack.views(pack.buffer, share=1))
    assert list(mine) == [params[1]] and mine[params[1]].data_ptr() == pack.buffer[1000:].data_ptr()
    # Two tensors of equal size in a bucket of two workers: scattered, no padding.
    even = [torch.zeros(10, 10), torch.zeros(10, 10)]
    pack = hierarchy._Pack(even, {"0": 0, "1": 1}, {p: str(i) for i, p in enumerate(even)}, 2, 0)
    scattered, whole = pack.padded_work()
    assert scattered < whole


def test_one_tensor_in_a_bucket_of_two_workers_is_reduced_whole():
    """Scattered and whole send the same bytes here (L·(L-1)·n = 2·(L-1)·n at L = 2);
    the tie goes to the two all-reduces: on the two-node ground (Open MPI, shared memory)
    the padded reduce-scatter of the LSTM's 75 MB embedding took 0.46-0.94 s, two
    all-reduces of it 0.17 s each (docs/hierarchical.md)."""
    params = [torch.zeros(30, 20)]
    names = {params[0]: "e"}
    bucket = types.SimpleNamespace(dense=params, params=params)
    reducer = types.SimpleNamespace(
        buckets=[bucket], owner={"e": 0}, names=names,
        hierarchy=types.SimpleNamespace(local_rank=1, local_size=2), _compressed=set(),
    )  # fmt: skip
    hierarchy.HierarchicalReducer._layout(reducer)
    scattered, whole = bucket.packs[0].padded_work()
    assert scattered == whole == 1200
    assert not bucket.scattered and bucket.packs[0].buffer.shape == (600,)
    assert bucket.shared_plain == []  # local rank 1 owns nothing of it


def test_a_bfloat16_pack_travels_as_float32():
    params = [torch.zeros(4, dtype=torch.bfloat16)]
    pack = hierarchy._Pack(params, {"0": 0}, {params[0]: "0"}, 2, me=0)
    pack.build(scattered=True)
    assert pack.buffer.dtype == torch.float32


class FakeComm:
    def __init__(self, rows, set_id=0):
        self.rows, self.size = rows, len(rows)
        self.process_set = types.SimpleNamespace(process_set_id=set_id)
        self.gathered = 0

    def allgather(self, tensor, name):
        self.gathered += 1
        return torch.tensor(self.rows)


def grid(per_node, dynamic=1):
    """Rows of comm.node_layout() for nodes of `per_node` workers each."""
    rows = []
    for node, size in enumerate(per_node):
        rows += [[j, size, node, len(per_node), dynamic] for j in range(size)]
    return rows


def decide(setting, rows, **kw):
    kw = {"elastic": False, **kw}
    return hierarchy.decide(setting, FakeComm(rows, kw.pop("set_id", 0)), **kw)


def test_false_decides_without_a_collective():
    comm = FakeComm(grid([2, 2]))
    assert hierarchy.decide(False, comm, elastic=False) is None
    assert comm.gathered == 0


@pytest.mark.parametrize(
    "kw, cause",
    [({"elastic": True}, "elastic"), ({"set_id": 3}, "global process set")],
)  # fmt: skip
def test_true_refuses_what_it_cannot_do_and_auto_runs_flat(monkeypatch, kw, cause):
    with pytest.raises(ValueError, match=cause):
        decide(True, grid([2, 2]), **kw)
    assert decide("auto", grid([2, 2]), **kw) is None


def test_auto_and_true_may_be_on_wherever_the_node_layout_allows():
    # "auto" with rank="auto" is possible too: the tuner then chooses it or flat from its
    # measurements (state.PowerSGDState.node_layout); only the job's shape rules it out.
    global_set = types.SimpleNamespace(process_set_id=0)
    assert hierarchy.check(True, global_set, elastic=False)
    assert hierarchy.check("auto", global_set, elastic=False)
    assert not hierarchy.check("auto", global_set, elastic=True)


def test_uneven_nodes_raise_with_true_naming_them_and_run_flat_with_auto(monkeypatch):
    monkeypatch.setattr(hvd_comm, "node_layout", lambda: [0, 2, 0, 2, 1])
    rows = grid([2, 1])
    rows = [[j, s, n, 2, d] for j, s, n, _, d in rows]
    with pytest.raises(ValueError, match=r"same number of workers on every node.*\[1, 2\]"):
        decide(True, rows)
    assert decide("auto", rows) is None


@pytest.mark.parametrize("per_node, what", [([1, 1, 1], "nothing to share"), ([4], "one node")])
def test_nothing_to_gain_warns_with_true_and_is_silent_with_auto(monkeypatch, per_node, what):
    monkeypatch.setattr(hvd_comm, "node_layout", lambda: [0, 1, 0, 1, 1])
    with pytest.warns(UserWarning, match=what):
        assert decide(True, grid(per_node)) is None
    assert decide("auto", grid(per_node)) is None


def test_missing_dynamic_process_sets_on_any_rank_says_how_to_enable_them(monkeypatch):
    monkeypatch.setattr(hvd_comm, "node_layout", lambda: [0, 2, 0, 2, 1])
    rows = grid([2, 2])
    rows[3][4] = 0  # one rank without the variable: every rank decides alike
    with pytest.raises(ValueError, match="HOROVOD_DYNAMIC_PROCESS_SETS=1"):
        decide(True, rows)
    with pytest.warns(UserWarning, match="runs flat"):
        assert decide("auto", rows) is None


def test_a_wide_matrix_too_large_for_one_share_is_split_by_columns():
    """The Fashion-MNIST CNN's fc1 (256 x 6,272, 94 % of its gradient) is too wide to be
    split by rows: its columns are shared out instead, each share a 256 x 3,136 block
    of its own (the blocks strided in p.grad, copied in and out), and the result put
    back in place; a 2-D tensor only (a wide conv weight stays whole)."""
    assert shares.split_of((256, 6272), 2) == shares.SPLIT_COLUMNS
    assert shares.split_of((256, 64, 98), 2) is None
    params = [torch.zeros(4, 64), torch.zeros(4)]
    owner, names, _ = owners_of(params, 2)
    assert owner == {"p0": shares.SPLIT_COLUMNS, "p1": 0}
    me = types.SimpleNamespace(local_rank=1, local_size=2)
    mine = hierarchy.Hierarchy.mine(me, params, owner, names)
    assert [(n, tuple(t.shape)) for n, t in mine] == [("p0", (4, 32))]
    for scattered in (True, False):
        pack = hierarchy._Pack(params, owner, names, 2, me=1)
        assert pack.sizes == [128, 128, 4] and pack.owner == [0, 1, 0]
        pack.build(scattered=scattered)
        grads = [torch.arange(256.0).view(4, 64), torch.arange(4.0) + 1000]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        torch._foreach_copy_(pack.send_views, pack.grads())
        share = dict(pack.views(pack.buffer[1] if scattered else pack.buffer, share=1))
        assert torch.equal(share[params[0]], grads[0][:, 32:])
        for p in params:
            p.grad.zero_()
        torch._foreach_copy_(pack.grads(), [v for _, v in pack.views(pack.buffer)])
        assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))
