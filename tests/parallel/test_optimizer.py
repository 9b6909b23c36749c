"""DistributedOptimizer under real Horovod collectives; every rank runs every test."""

import os
import sys
import warnings

import helpers
import horovod.torch as hvd
import pytest
import torch
import torch.nn.functional as F
from helpers import (
    assert_same_on_every_rank,
    batch,
    local_gradients,
    make_model,
    powersgd,
    train,
)
from torch import nn

import horovod_powersgd as hps


def test_full_rank_equals_plain_horovod_average():
    model = make_model()
    opt = powersgd(model, rank=64, min_compression_rate=0)
    assert len(opt.compressor.compressed_names) == 3
    x, y = batch(0)
    loss = F.cross_entropy(model(x), y)
    raw = local_gradients(model, loss)
    loss.backward()
    expected = {n: hvd.allreduce(g, name=f"expected.{n}", op=hvd.Average) for n, g in raw.items()}
    opt.synchronize()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-4, atol=1e-6)


def test_sum_and_predivide_keep_horovods_meaning():
    results = {}
    for key, kwargs in {
        "avg": {},
        "sum": {"op": hvd.Sum},
        "predivide": {"gradient_predivide_factor": 2.0},
    }.items():
        model = make_model()
        opt = powersgd(model, rank=64, min_compression_rate=0, **kwargs)
        x, y = batch(0)
        F.cross_entropy(model(x), y).backward()
        opt.synchronize()
        results[key] = [p.grad.clone() for p in model.parameters()]
    for avg, total, pre in zip(results["avg"], results["sum"], results["predivide"]):
        torch.testing.assert_close(total, avg * hvd.size(), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(pre, avg, rtol=1e-4, atol=1e-6)


def test_parameters_bitwise_identical_on_every_rank_after_many_steps():
    model = make_model()
    opt = powersgd(model, rank=2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    train(model, opt, steps=30)
    assert opt.compression_stats()["ratio"] > 1
    for n, p in model.named_parameters():
        assert torch.isfinite(p).all()
        assert_same_on_every_rank(p, n)


def test_first_start_iter_steps_equal_plain_horovod():
    plain_model, ours_model = make_model(), make_model()
    plain = hvd.DistributedOptimizer(
        torch.optim.SGD(plain_model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=plain_model.named_parameters(),
    )
    ours = powersgd(ours_model, rank=2, start_iter=5)
    train(plain_model, plain, steps=5)
    train(ours_model, ours, steps=5)
    for (n, a), b in zip(plain_model.named_parameters(), ours_model.parameters()):
        if hvd.size() <= 2:  # a sum of two floats does not depend on the order
            assert torch.equal(a, b), n
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    stats = ours.compression_stats()
    assert stats["elements_sent"] == stats["elements_uncompressed"]
    train(ours_model, ours, steps=1, first_step=5)
    stats = ours.compression_stats()
    assert stats["elements_sent"] < stats["elements_uncompressed"]


@pytest.mark.parametrize("rate", [1e12, 2.0], ids=["uncompressed", "compressed"])
def test_backward_passes_per_step_equals_one_pass_over_the_combined_batch(rate):
    grads = []
    for passes in (1, 2):
        model = make_model()
        opt = powersgd(model, rank=2, min_compression_rate=rate, backward_passes_per_step=passes)
        x, y = batch(0, size=32)
        for chunk_x, chunk_y in zip(x.chunk(passes), y.chunk(passes)):
            (F.cross_entropy(model(chunk_x), chunk_y) / passes).backward()
        opt.synchronize()
        grads.append([p.grad.clone() for p in model.parameters()])
        assert opt.compression_stats()["steps"] == 1
    for one, two in zip(*grads):
        torch.testing.assert_close(two, one, rtol=1e-4, atol=1e-6)


def test_more_backward_passes_than_configured_raises():
    model = make_model()
    opt = powersgd(model, backward_passes_per_step=1)
    x, y = batch(0)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(AssertionError, match="backward_passes_per_step"):
        F.cross_entropy(model(x), y).backward()
    opt.synchronize()


def test_compression_stats_follow_the_formula():
    # weights 128x256 and 10x128 are compressed at rank 2; biases (128 + 10) are not.
    full = 128 * 256 + 128 + 10 * 128 + 10
    p_q = 2 * (128 + 256) + 2 * (10 + 128)
    for comm_dtype, pq_bytes in ((None, 4), (torch.float16, 2)):
        model = nn.Sequential(nn.Linear(256, 128), nn.Linear(128, 10))
        opt = powersgd(model, rank=2, start_iter=1, comm_dtype=comm_dtype)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 256)).sum().backward()
            opt.step()
        stats = opt.compression_stats()
        assert stats["steps"] == 3
        assert stats["elements_uncompressed"] == 3 * full
        # step 0 is a plain all-reduce (start_iter=1), steps 1-2 send P, Q and the biases
        assert stats["elements_sent"] == full + 2 * (p_q + 138)
        # comm_dtype applies to everything a compressed step sends, biases included
        assert stats["bytes_sent"] == 4 * full + 2 * pq_bytes * (p_q + 138)
        assert stats["ratio"] == stats["elements_uncompressed"] / stats["elements_sent"]


def test_load_state_dict_of_another_model_fails_and_keeps_state():
    model, other = make_model(), nn.Sequential(nn.Linear(32, 80), nn.Linear(80, 10))
    opt = powersgd(model, rank=2)
    other_opt = powersgd(other, rank=2)
    train(model, opt, steps=1)
    before = {k: v.clone() for k, v in opt.compressor.state_dict()["error_buffers"].items()}
    with pytest.raises(ValueError, match="PowerSGD checkpoint"):
        opt.load_state_dict(other_opt.state_dict())
    after = opt.compressor.state_dict()["error_buffers"]
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_broadcast_optimizer_state_at_start_runs_no_powersgd_step():
    model = make_model(seed=hvd.rank())  # different on every rank until broadcast
    opt = powersgd(model, rank=2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.compression_stats()["steps"] == 0
    for n, p in model.named_parameters():
        assert_same_on_every_rank(p, n)
        assert_same_on_every_rank(opt.state[p]["momentum_buffer"], f"momentum.{n}")
    train(model, opt, steps=3)
    for n, p in model.named_parameters():
        assert_same_on_every_rank(p, n)


def test_unused_and_non_finite_gradients_leave_state_finite():
    model = make_model()
    unused = nn.Linear(64, 64).to(helpers.DEVICE)  # no gradient: sent as zeros, like Horovod
    params = [
        *model.named_parameters(),
        *(("unused." + n, p) for n, p in unused.named_parameters()),
    ]
    opt = hps.DistributedOptimizer(
        torch.optim.SGD([p for _, p in params], lr=0.05), named_parameters=params, rank=2
    )
    train(model, opt, steps=2)
    assert torch.equal(unused.weight.grad, torch.zeros_like(unused.weight))
    x, y = batch(2)
    if hvd.rank() == hvd.size() - 1:
        x[0, 0] = float("nan")  # an overflow on one rank only
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.synchronize()
    # every rank sees the overflow (so a GradScaler would skip the step everywhere) ...
    assert not all(torch.isfinite(p.grad).all() for p in model.parameters())
    # ... and no NaN/Inf stays in the PowerSGD state
    state = opt.compressor.state_dict()
    for kind in ("error_buffers", "q_memory"):
        for n, t in state[kind].items():
            assert torch.isfinite(t).all(), f"{kind}[{n}]"
    # The poisoned step is skipped, as GradScaler would do; training goes on.
    train(model, opt, steps=3, first_step=3)
    for n, p in model.named_parameters():
        assert torch.isfinite(p).all(), n
        assert_same_on_every_rank(p, n)


def test_amp_grad_scaler_and_clipping_pattern():
    model = make_model()
    opt = powersgd(model, rank=2)
    scaler = torch.amp.GradScaler(helpers.DEVICE.type, init_scale=1024.0)
    before = [p.detach().clone() for p in model.parameters()]
    for step in range(3):
        x, y = batch(step)
        if step == 1 and hvd.rank() == 0:
            x[0, 0] = float("inf")
        opt.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        if step == 0:
            first = [p.detach().clone() for p in model.parameters()]
        if step == 1:  # skipped on every rank: parameters unchanged
            assert all(torch.equal(a, b) for a, b in zip(first, model.parameters()))
    assert scaler.get_scale() < 1024.0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    for n, p in model.named_parameters():
        assert torch.isfinite(p).all()
        assert_same_on_every_rank(p, n)


def test_zero_grad_with_pending_work_raises_and_step_after_synchronize_warns():
    model = make_model()
    opt = powersgd(model, rank=2)
    x, y = batch(0)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(AssertionError, match="zero_grad"):
        opt.zero_grad()
    opt.synchronize()
    with pytest.warns(UserWarning, match="skip_synchronize"):
        opt.step()


def test_a_new_optimizer_can_replace_an_old_one_on_the_same_model():
    model = make_model()
    opt = powersgd(model, rank=2)
    train(model, opt, steps=2)
    del opt  # e.g. rebuilt with other settings: the old hooks must not interfere
    opt = powersgd(model, rank=4)
    train(model, opt, steps=2)
    assert opt.compression_stats()["steps"] == 2
    for n, p in model.named_parameters():
        assert_same_on_every_rank(p, n)


def test_bfloat16_model_trains():
    model = make_model(dtype=torch.bfloat16)
    opt = powersgd(model, rank=2)
    x, y = batch(0, size=64, dtype=torch.bfloat16)
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    for n, p in model.named_parameters():
        assert p.dtype == torch.bfloat16
        assert_same_on_every_rank(p, n)


# --- bad input: a clear error on every rank, before any collective could hang ---------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 0}, "rank"),
        ({"rank": 1.5}, "rank"),
        ({"min_compression_rate": -1}, "min_compression_rate"),
        ({"op": hvd.Adasum}, "Adasum"),
        ({"op": "mean"}, "op must be"),
        ({"comm_dtype": torch.int32}, "comm_dtype"),
        ({"comm_dtype": torch.bfloat16}, "bfloat16"),
        ({"op": hvd.Sum, "gradient_predivide_factor": 2.0}, "gradient_predivide_factor"),
        ({"compression": object()}, "compression must be a Horovod compressor"),
        (
            {"compression": hvd.Compression.fp16, "comm_dtype": torch.float32},
            "conflicts with comm_dtype",
        ),
        ({"groups": -1}, "groups should be"),
        ({"groups": [[torch.zeros(1), "w"]]}, "groups must consist of torch.Tensor"),
        ({"sparse_as_dense": 1}, "sparse_as_dense"),
    ],
)
def test_bad_settings_raise(kwargs, message):
    model = make_model()
    with pytest.raises(ValueError, match=message):
        powersgd(model, **kwargs)


def test_bad_named_parameters_raise():
    model = make_model()
    named = list(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="unique"):
        hps.DistributedOptimizer(opt, named_parameters=[named[0], (named[0][0], named[1][1])])
    with pytest.raises(ValueError, match="missing from named_parameters"):
        hps.DistributedOptimizer(opt, named_parameters=named[:-1])


@pytest.mark.world_size(2)
def test_shapes_that_differ_across_ranks_raise_on_every_rank():
    torch.manual_seed(0)
    width = 64 if hvd.rank() == 0 else 65
    model = nn.Sequential(nn.Linear(32, width), nn.Linear(width, 10))
    with pytest.raises(ValueError, match="differ across ranks"):
        powersgd(model)


@pytest.mark.world_size(2)
def test_parameter_count_or_settings_that_differ_across_ranks_raise_on_every_rank():
    layers = [nn.Linear(32, 64), nn.Linear(64, 10)]
    if hvd.rank() == 1:
        layers.append(nn.Linear(10, 10))
    with pytest.raises(ValueError, match="differ across ranks"):
        powersgd(nn.Sequential(*layers))
    # The setting that differs is named, with each rank's value, and nothing else.
    with pytest.raises(ValueError, match="differ across ranks") as raised:
        powersgd(make_model(), rank=2 + hvd.rank(), seed=5)
    message = str(raised.value)
    assert "rank=2 on rank " in message and "rank=3 on rank " in message, message
    assert "seed" not in message and "min_compression_rate" not in message, message


@pytest.mark.world_size(2)
def test_rank_outside_the_process_set_trains_on_its_own_gradients_like_horovod():
    only_rank0 = hvd.add_process_set([0])
    try:
        model, local = make_model(), make_model()
        opt = powersgd(model, process_set=only_rank0)
        local_opt = torch.optim.SGD(local.parameters(), lr=0.05, momentum=0.9)
        train(model, opt, steps=2)
        train(local, local_opt, steps=2)
        if hvd.rank() == 1:  # outside the set: no communication, a plain local step
            assert opt.compression_stats()["steps"] == 0
            for a, b in zip(model.parameters(), local.parameters()):
                assert torch.equal(a, b)
        else:  # a set of one: PowerSGD steps on its own
            assert opt.compression_stats()["steps"] == 2
    finally:
        hvd.remove_process_set(only_rank0)


# --- convergence smoke test on real data -------------------------------------------------------
FASHION = "/usr/share/datasets/fashion-mnist"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from fashion_mnist import read_idx  # noqa: E402  (the example's own IDX reader)

# Seeds of the runs the bounds below compare, each a different data order,
# initialisation and PowerSGD seed.
CONVERGENCE_SEEDS = (0, 1, 2, 3)


# The bounds come from the spread over seeds, not from one run: one 200-step
# trajectory's test loss depends on the processor's floating point (BLAS
# kernels, summation order) about as much as on the seed, so a bound tuned to
# one run on one CPU fails on another (issue 22). Measured on a 2-core AMD EPYC
# with seeds 0-11 (docs/results/rounds.md): the ratio of compressed to plain
# test loss per seed spans 0.97-1.04 for rounds=2 (sd 0.023) and 1.07-1.40
# for rounds=1 (sd 0.12). Over all 495 sets of 4 of those seeds, the ratio of
# the mean losses reached at most 1.033 (rounds=2; mean 1.011, sd 0.010) and
# 1.339 (rounds=1; mean 1.187, sd 0.048). The limits sit 5 sd above the
# mean, beyond every measured set: 1.06 and 1.45. Every run must also learn:
# the worst loss seen was 0.80; chance is ln(10) = 2.30.
@pytest.mark.parametrize(("rounds", "limit"), [(2, 1.06), (1, 1.45)], ids=["rounds2", "rounds1"])
def test_rank2_converges_like_plain_horovod_on_fashion_mnist(rounds, limit):
    images = read_idx(f"{FASHION}/train-images-idx3-ubyte.gz")[:4096].float().div(255).flatten(1)
    labels = read_idx(f"{FASHION}/train-labels-idx1-ubyte.gz")[:4096].long()
    test_x = read_idx(f"{FASHION}/t10k-images-idx3-ubyte.gz")[:1000].float().div(255).flatten(1)
    test_y = read_idx(f"{FASHION}/t10k-labels-idx1-ubyte.gz")[:1000].long()
    shard = slice(hvd.rank(), None, hvd.size())  # each rank its own share
    x, y = images[shard], labels[shard]

    def run(seed, rank, rounds=2):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
        # A moderate step size: at lr 0.1 a single 150-step trajectory's test
        # loss varied by +-20 % with the seed for plain and PowerSGD alike.
        sgd = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
        if rank:
            opt = hps.DistributedOptimizer(
                sgd, model.named_parameters(), rank=rank, rounds=rounds, seed=seed
            )
        else:
            opt = hvd.DistributedOptimizer(sgd, model.named_parameters())
        g = torch.Generator().manual_seed(1000 * seed + hvd.rank())
        for _ in range(200):
            idx = torch.randint(0, len(x), (32,), generator=g)
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        with torch.no_grad():
            return F.cross_entropy(model(test_x), test_y).item(), opt

    plain = [run(seed, 0)[0] for seed in CONVERGENCE_SEEDS]
    compressed = []
    for seed in CONVERGENCE_SEEDS:
        loss, opt = run(seed, 2, rounds)
        assert opt.compression_stats()["ratio"] > 10
        assert loss < 1.0, (seed, loss)  # it learned
        compressed.append(loss)
    assert sum(compressed) <= limit * sum(plain), (compressed, plain)


def test_no_warnings_in_normal_use():
    model = make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = powersgd(model, rank=2)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        train(model, opt, steps=2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_float64_and_bfloat16_models_train_with_the_default_settings(dtype):
    # As with Horovod: model.double() (or bfloat16 weights) and nothing else changed;
    # 12 steps take in a statistics check (every 10) and the first-step drift check.
    model = make_model(dtype=dtype)
    opt = powersgd(model)
    train(model, opt, steps=12, dtype=dtype)
    assert opt.compression_stats()["ratio"] > 1
    layers = opt.compression_stats(per_layer=True)["layers"]
    assert layers and all(layer["avg_relative_error"] is not None for layer in layers)
    for n, p in model.named_parameters():
        assert p.dtype == dtype and torch.isfinite(p).all(), n
        assert_same_on_every_rank(p, n)
