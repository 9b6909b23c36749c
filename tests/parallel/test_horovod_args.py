"""Every argument of hvd.DistributedOptimizer works here, in Horovod's order and meaning."""

import inspect

import horovod.torch as hvd
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same_on_every_rank, batch, make_model, powersgd, train
from torch import nn

import horovod_powersgd as hps

HOROVOD_ARGS = [
    "optimizer",
    "named_parameters",
    "compression",
    "backward_passes_per_step",
    "op",
    "gradient_predivide_factor",
    "num_groups",
    "groups",
    "sparse_as_dense",
    "process_set",
]


def test_signature_is_horovods_then_powersgd_settings_keyword_only():
    ours = inspect.signature(hps.DistributedOptimizer).parameters
    theirs = inspect.signature(hvd.DistributedOptimizer).parameters
    assert list(theirs) == HOROVOD_ARGS  # the Horovod this was written against
    assert list(ours)[: len(HOROVOD_ARGS)] == HOROVOD_ARGS
    for name in HOROVOD_ARGS[1:]:
        assert ours[name].default == theirs[name].default, name
    powersgd_settings = list(ours)[len(HOROVOD_ARGS) :]
    assert "rank" in powersgd_settings
    assert all(ours[n].kind is inspect.Parameter.KEYWORD_ONLY for n in powersgd_settings)


def test_horovods_positional_call_works_and_an_eleventh_positional_is_refused():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    args = [
        model.named_parameters(),
        hvd.Compression.none,
        1,
        hvd.Average,
        1.0,
        0,
        None,
        False,
        hvd.global_process_set,
    ]
    ours = hps.DistributedOptimizer(opt, *args)
    train(model, ours, steps=2)
    assert ours.compression_stats()["steps"] == 2
    with pytest.raises(TypeError):
        hps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), *args, 2)


def _run(kind, steps=3, **kwargs):
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if kind == "horovod":
        opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), **kwargs)
    else:
        opt = hps.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), **kwargs)
    train(model, opt, steps=steps)
    return model, opt


def test_fp16_compression_warm_up_equals_horovods_fp16_and_halves_every_step():
    # Warm-up steps are plain Horovod, so with fp16 they are Horovod's fp16 exactly.
    plain, _ = _run("horovod", compression=hvd.Compression.fp16)
    ours, opt = _run("powersgd", compression=hvd.Compression.fp16, start_iter=3)
    for (n, a), b in zip(plain.named_parameters(), ours.parameters()):
        if hvd.size() <= 2:  # a sum of two numbers does not depend on the order
            assert torch.equal(a, b), n
        else:
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
    numel = sum(p.numel() for p in ours.parameters())
    assert opt.compression_stats()["bytes_sent"] == 3 * 2 * numel  # float16 on the wire
    # Compressed steps: half the bytes of the same steps in float32.
    _, fp16 = _run("powersgd", compression=hvd.Compression.fp16, start_iter=3, steps=6)
    _, fp32 = _run("powersgd", start_iter=3, steps=6)
    compressed_bytes = {
        k: o.compression_stats()["bytes_sent"] - b * 3 * numel
        for k, o, b in (("fp16", fp16, 2), ("fp32", fp32, 4))
    }
    assert compressed_bytes["fp16"] * 2 == compressed_bytes["fp32"]


class CountingFP64(hvd.compression.Compressor):
    """A user's own compressor: sends float64 and counts what it compressed."""

    calls = 0

    @staticmethod
    def compress(tensor):
        CountingFP64.calls += 1
        return tensor.double(), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx)


def test_a_users_compressor_applies_to_the_tensors_that_travel_uncompressed():
    CountingFP64.calls = 0
    _run("horovod", compression=CountingFP64, steps=2)
    horovod_calls, CountingFP64.calls = CountingFP64.calls, 0
    model, opt = _run("powersgd", compression=CountingFP64, start_iter=1, steps=2)
    # Step 0 (warm-up) compresses every tensor as Horovod does; step 1 the three biases.
    assert CountingFP64.calls == horovod_calls // 2 + 3
    numel = sum(p.numel() for p in model.parameters())
    biases = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    p_and_q = opt.compression_stats()["elements_sent"] - numel - biases
    assert opt.compression_stats()["bytes_sent"] == 8 * numel + 8 * biases + 4 * p_and_q


def test_groups_and_num_groups_are_accepted_and_change_nothing_sent():
    baseline, _ = _run("powersgd")
    model = make_model()
    layers = [m for m in model if isinstance(m, nn.Linear)]
    grouped, _ = _run("powersgd", groups=[[layers[0].weight, layers[1].weight]])
    with pytest.warns(DeprecationWarning, match="num_groups"):
        numbered, _ = _run("powersgd", num_groups=2)
    for a, b, c in zip(baseline.parameters(), grouped.parameters(), numbered.parameters()):
        assert torch.equal(a, b)
        assert torch.equal(a, c)


def test_sparse_as_dense_compresses_sparse_embedding_gradients():
    torch.manual_seed(0)
    emb = nn.Embedding(200, 32, sparse=True)
    opt = hps.DistributedOptimizer(
        torch.optim.SGD(emb.parameters(), lr=0.1),
        named_parameters=emb.named_parameters(),
        sparse_as_dense=True,
        rank=2,
    )
    assert opt.compressor.is_compressed("weight")
    hvd.broadcast_parameters(emb.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(hvd.rank())
    for _ in range(3):
        opt.zero_grad()
        emb(torch.randint(0, 200, (16,), generator=g)).pow(2).sum().backward()
        opt.step()
    assert emb.weight.grad.is_sparse  # handed back sparse, as Horovod does
    assert opt.compression_stats()["ratio"] > 10
    assert_same_on_every_rank(emb.weight, "embedding")


def test_set_backward_passes_per_step_as_in_horovod():
    model = make_model()
    opt = powersgd(model, rank=2)
    opt.set_backward_passes_per_step(2)
    assert opt.backward_passes_per_step == 2
    for _ in range(2):
        x, y = batch(0)
        F.cross_entropy(model(x), y).backward()  # two passes, no step yet
    assert opt.compression_stats()["steps"] == 0
    opt.step()
    assert opt.compression_stats()["steps"] == 1
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        opt.set_backward_passes_per_step(0)
