"""compressor.local_step, the one driver of the local step outside the reducer, runs what
the reducer runs: on one worker its gradients are the reducer's, bit for bit. rank="auto"
times it to choose each bucket's rank, and the GPU kit times it: a probe that drifted from
the reducer's order would time (and choose by) another step than the job's. (One
difference, by design: the reducer projects every bucket's P at once, the probe a bucket's
alone, so a bucket's time there is what its projection costs alone, at most its share of
the joined one.)"""

import pytest
import torch

from horovod_powersgd import linalg
from horovod_powersgd import reducer as reducer_module
from horovod_powersgd.comm import Compression, Packed
from horovod_powersgd.compressor import PowerSGDCompressor, local_step
from horovod_powersgd.config import PowerSGDConfig
from horovod_powersgd.reducer import Reducer, make_buckets

SHAPES = [(64, 32), (32,), (24, 3, 3, 3), (40, 50), (50,), (30, 40)]


class Loopback:
    """One worker's collectives: every sum is the tensor itself."""

    size = 1
    compression = Compression.none

    def allreduce_async(self, tensors, name):
        return tensors

    def wait(self, handle):
        return handle

    def poll(self, handle):
        return True

    def to_wire(self, grad, comm_dtype):
        return (grad if comm_dtype is None else grad.to(comm_dtype)), None

    def from_wire(self, tensor, ctx):
        return tensor

    def pack(self, grads, comm_dtype):
        return Packed(self, grads, comm_dtype)


def _compressor(params, names, buckets, rounds):
    config = PowerSGDConfig(rank=2, rounds=rounds, seed=3)
    bucket_of = {names[p]: b.index for b in buckets for p in b.params}
    return PowerSGDCompressor([(names[p], p) for p in params], config, bucket_of=bucket_of)


@pytest.mark.parametrize("method", ["householder", "cholesky"])
@pytest.mark.parametrize("rounds", [1, 2])
def test_local_step_is_the_reducers_step_on_one_worker(monkeypatch, rounds, method):
    # Bit for bit, but for one difference: with rounds=2 the reducer orthogonalises every
    # bucket's P at once (one padded batch across buckets) where the probe does each
    # bucket's alone. CholeskyQR gives each matrix the same bits whatever its batch;
    # Householder's rounding depends on the padding: measured at most 9.3e-7 of the
    # gradient's largest entry (seeds 0-4, 4 steps each); the bound, 1e-5, leaves 10x.
    monkeypatch.setattr(reducer_module, "BUCKET_BYTES", 4 * 1024)  # several buckets
    monkeypatch.setattr(linalg, "METHOD", method)
    exact = rounds == 1 or method == "cholesky"
    torch.manual_seed(0)
    params = [torch.zeros(shape) for shape in SHAPES]
    names = {p: f"p{i}" for i, p in enumerate(params)}
    buckets = make_buckets(params)
    assert len(buckets) >= 3
    live = _compressor(params, names, buckets, rounds)
    reducer = Reducer(buckets, names, live, Loopback())
    probe = _compressor(params, names, buckets, rounds)
    compressed = [names[p] for p in params if live.is_compressed(names[p])]
    assert len(compressed) == 4
    for done in range(4):  # both parities, cold and warm memories
        grads = {names[p]: torch.randn(p.shape) for p in params}
        reducer.begin(done=done)
        for p in reversed(params):  # the order backward's hooks fire in
            p.grad = grads[names[p]].clone()
            reducer.ready(p)
        reducer.finish()
        reducer.reset()
        probe.begin_step(workers=1, done=done)  # every bucket's partners, as the reducer
        out = {name: torch.empty_like(grads[name]) for name in compressed}
        ran = []
        for bucket in buckets:
            ran += local_step(probe, bucket.index, grads, out, done=done, partners=False)
        assert sorted(ran) == sorted(compressed)
        for p in params:
            if names[p] in compressed:
                gap = (out[names[p]] - p.grad).abs().max() / p.grad.abs().max()
                assert gap == 0 if exact else gap < 1e-5, (rounds, done, names[p], gap)
                assert not torch.equal(p.grad, grads[names[p]])  # compressed: not the input


def test_local_step_marks_each_segment_after_it_is_queued():
    params = [torch.zeros(40, 50), torch.zeros(30, 40)]
    names = {p: f"p{i}" for i, p in enumerate(params)}
    buckets = make_buckets(params)
    for rounds, segments in [
        (2, ["partners", "compress", "project", "error", "decompress"]),
        (1, ["partners", "compress", "decompress"]),
    ]:
        probe = _compressor(params, names, buckets, rounds)
        grads = {names[p]: torch.randn(p.shape) for p in params}
        out = {name: torch.zeros_like(g) for name, g in grads.items()}
        seen = []
        local_step(probe, buckets[0].index, grads, out, mark=seen.append)
        assert seen == segments
        assert all(out[name].abs().sum() > 0 for name in grads)  # written
        assert local_step(probe, 99, grads, out, mark=seen.append) == []  # no such bucket
