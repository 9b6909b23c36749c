"""Per-layer statistics, the log line and the early warning, on every rank."""

import copy
import logging
import math
import os
import sys
import warnings

import horovod.torch as hvd
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same_on_every_rank, batch, make_model, powersgd, train

import horovod_powersgd as hps
from horovod_powersgd import monitor

SCHEDULES = [2, 1]


def _direct_relative_error(opt, name, matrix):
    """‖M − Π·M‖ / ‖M‖ for the orthonormal partner Π this step projected `name` onto."""
    group, i = opt.compressor._where[name]
    if opt.config.rounds == 2:
        left = group.p[i]  # P̂ after the step: M is approximated by P̂·P̂ᵀ·M
        approx = left @ (left.T @ matrix)
    elif group.sends[0] == "q":  # step 0 of rounds=1 sends Q_w = Mᵀ·P̂ (P̂ from memory)
        left = group.p_memory[i]
        approx = left @ (left.T @ matrix)
    else:
        right = group.q_memory[i]
        approx = (matrix @ right) @ right.T
    return float(torch.linalg.norm(matrix - approx) / torch.linalg.norm(matrix))


@pytest.mark.parametrize("rounds", SCHEDULES, ids=["rounds2", "rounds1"])
def test_relative_error_of_one_step_equals_the_direct_computation(rounds):
    model = make_model()
    opt = powersgd(model, rank=2, rounds=rounds)
    x, y = batch(0)
    F.cross_entropy(model(x), y).backward()
    # First step: the error buffers are zero, so M is this rank's own gradient.
    local = {name: p.grad.clone() for name, p in model.named_parameters()}
    opt.step()
    layers = opt.compression_stats(per_layer=True)["layers"]
    assert [layer["name"] for layer in layers] == opt.compressor.compressed_names
    for layer in layers:
        n, m = layer["matrix"]
        matrix = local[layer["name"]].reshape(n, m)
        expected = _direct_relative_error(opt, layer["name"], matrix)
        assert 0.05 < expected < 1
        assert layer["relative_error"] == pytest.approx(expected, rel=1e-4)
        # The error buffer after one step is the residual ‖M − P̂Qᵀ‖ = relative error · ‖M‖.
        assert layer["error_ratio"] == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("rounds", SCHEDULES, ids=["rounds2", "rounds1"])
def test_full_rank_has_no_approximation_error(rounds):
    model = make_model()
    opt = powersgd(model, rank=64, rounds=rounds, min_compression_rate=0)
    train(model, opt, steps=3)
    layers = opt.compression_stats(per_layer=True)["layers"]
    assert len(layers) == 3
    for layer in layers:
        assert layer["rank"] == min(layer["matrix"])
        assert layer["relative_error"] < 1e-3
        assert layer["error_ratio"] < 1e-3


@pytest.mark.parametrize("rounds", SCHEDULES, ids=["rounds2", "rounds1"])
def test_per_layer_elements_add_up_to_the_bytes_sent(rounds):
    model = make_model()
    opt = powersgd(model, rank=2, rounds=rounds)
    train(model, opt, steps=4)  # an even number: rounds=1 sent P and Q twice each
    stats = opt.compression_stats(per_layer=True)
    compressed = {layer["name"] for layer in stats["layers"]}
    uncompressed = sum(p.numel() for n, p in model.named_parameters() if n not in compressed)
    per_step = sum(layer["elements_per_step"] for layer in stats["layers"]) + uncompressed
    assert stats["elements_sent"] == 4 * per_step
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    for layer in stats["layers"]:
        assert layer["shape"] == shapes[layer["name"]]
        assert layer["rank"] == 2


def test_rank_averages_agree_on_every_rank_and_are_the_mean_of_the_ranks():
    model = make_model()
    opt = powersgd(model, rank=2)
    train(model, opt, steps=monitor.CHECK_EVERY)
    stats = opt.compression_stats(per_layer=True)
    assert stats["checked_step"] == monitor.CHECK_EVERY
    layers = stats["layers"]
    for key in ("avg_relative_error", "avg_error_ratio", "relative_error", "error_ratio"):
        assert all(layer[key] is not None and layer[key] > 0 for layer in layers)
    averaged = torch.tensor([[la["avg_relative_error"], la["avg_error_ratio"]] for la in layers])
    assert_same_on_every_rank(averaged, "stats.avg")
    local = torch.tensor([la["relative_error"] for la in layers])
    mean = hvd.allreduce(local, op=hvd.Average, name="stats.mean")
    assert torch.allclose(averaged[:, 0], mean, rtol=1e-5)


def test_log_line_on_rank_0_names_steps_ratio_bytes_and_worst_layers(caplog):
    model = make_model()
    # log_every may differ between ranks: only rank 0 logs, and logging sends nothing.
    opt = powersgd(model, rank=2, log_every=10 if hvd.rank() == 0 else 0)
    with caplog.at_level(logging.INFO, logger="horovod_powersgd"):
        train(model, opt, steps=20)
    lines = [r.getMessage() for r in caplog.records if r.name == "horovod_powersgd"]
    if hvd.rank() != 0:
        assert lines == []
        return
    assert len(lines) == 2
    stats = opt.compression_stats(per_layer=True)
    worst = max(stats["layers"], key=lambda layer: layer["avg_relative_error"])
    line = lines[-1]
    assert line.startswith("step 20: compression ")
    assert f"{stats['ratio']:.1f}x" in line
    assert f"{stats['bytes_sent'] / 1000:.1f} KB sent" in line
    assert f"worst relative error (mean of {hvd.size()} ranks, step 20): {worst['name']}" in line


def test_statistics_after_a_load_describe_the_loaded_state_only():
    # The averages and the early warning's history describe the error buffers of
    # the steps taken; after load_state_dict those buffers are the loaded ones
    # (under elastic Horovod, a rollback to the last commit), so both start again.
    model = make_model()
    opt = powersgd(model, rank=2)
    train(model, opt, steps=monitor.CHECK_EVERY)
    saved = copy.deepcopy(opt.state_dict())
    train(model, opt, steps=2 * monitor.CHECK_EVERY, first_step=monitor.CHECK_EVERY)
    assert opt.compression_stats(per_layer=True)["checked_step"] == 3 * monitor.CHECK_EVERY
    opt.load_state_dict(saved)
    stats = opt.compression_stats(per_layer=True)
    assert stats["checked_step"] is None
    for layer in stats["layers"]:
        assert layer["relative_error"] is None and layer["avg_relative_error"] is None, layer
    assert opt.powersgd_state.monitor._history == []
    train(model, opt, steps=monitor.CHECK_EVERY, first_step=monitor.CHECK_EVERY)
    stats = opt.compression_stats(per_layer=True)
    assert stats["checked_step"] == 2 * monitor.CHECK_EVERY  # the loaded counter went on
    assert all(layer["avg_relative_error"] > 0 for layer in stats["layers"])


def test_layer_stats_off_reports_no_layers():
    model = make_model()
    opt = powersgd(model, rank=2, layer_stats=False)
    train(model, opt, steps=monitor.CHECK_EVERY)
    stats = opt.compression_stats(per_layer=True)
    assert stats["layers"] == [] and stats["checked_step"] is None
    assert set(opt.compression_stats()) == {
        "steps",
        "elements_uncompressed",
        "elements_sent",
        "bytes_sent",
        "ratio",
    }


def test_layer_stats_that_differ_across_ranks_raise_on_every_rank():
    model = make_model()
    with pytest.raises(ValueError, match="settings"):
        powersgd(model, layer_stats=hvd.rank() == 0)


@pytest.mark.parametrize("log_every", [-1, 1.5, True])
def test_bad_log_every_raises(log_every):
    with pytest.raises(ValueError, match="log_every"):
        powersgd(make_model(), log_every=log_every)


# --- the early warning on real data ----------------------------------------------------------
FASHION = "/usr/share/datasets/fashion-mnist"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import fashion_mnist  # noqa: E402  (the examples themselves)
import lstm_language_model  # noqa: E402
import transformer_lm  # noqa: E402
from fashion_mnist import Net, load_split  # noqa: E402


def _train_fashion_cnn(steps, *, lr, rounds, start_iter, seed=42):
    """The setting of docs/results/rounds.md: the examples' CNN, 2 workers, batch 64.

    Returns (step of the warning or None, step of the first non-finite loss or None);
    stops at the first of the two.
    """
    torch.manual_seed(seed)
    images, labels = load_split(FASHION, "train", 20000).tensors
    model = Net()
    sgd = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    opt = hps.DistributedOptimizer(
        sgd, model.named_parameters(), rank=2, rounds=rounds, start_iter=start_iter
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    generator = torch.Generator().manual_seed(hvd.rank() + 100 * seed)
    warned = None
    for step in range(1, steps + 1):
        idx = torch.randint(0, len(images), (64,), generator=generator)
        opt.zero_grad()
        loss = F.cross_entropy(model(images[idx]), labels[idx])
        loss.backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        growth = [w for w in caught if issubclass(w.category, hps.ErrorGrowthWarning)]
        if growth and warned is None:
            warned = step
            message = str(growth[0].message)
            assert "rounds=2" in message and "higher rank" in message
        if not math.isfinite(loss.item()):
            return warned, step
        if warned:
            return warned, None
    return warned, None


@pytest.mark.world_size(2)
def test_early_warning_fires_before_the_rounds1_divergence_on_every_rank():
    # rounds=1 at lr 0.1 after 100 plain steps goes to NaN 43-64 steps into
    # compression (seeds 42-46, docs/results/early_warning.md); the warning must
    # come while every loss so far is finite.
    warned, non_finite = _train_fashion_cnn(200, lr=0.1, rounds=1, start_iter=100)
    assert non_finite is None, f"the loss was non-finite at step {non_finite} before a warning"
    assert warned is not None, "no warning in 100 compressed steps"
    assert_same_on_every_rank(torch.tensor([warned]), "warned.step")


@pytest.mark.world_size(2)
def test_no_early_warning_at_the_examples_settings():
    # examples/fashion_mnist.py and the convergence campaign: lr 0.01 per worker
    # (x 2 workers), rank 2, rounds=2, compressed from the first step.
    warned, non_finite = _train_fashion_cnn(200, lr=0.02, rounds=2, start_iter=0)
    assert non_finite is None
    assert warned is None, f"warned at step {warned}"


HOROVOD_MNIST = os.path.join(os.path.dirname(__file__), "horovod_style", "pytorch_mnist.py")


@pytest.mark.world_size(2)
def test_no_early_warning_on_horovods_mnist_example_with_the_line_swapped():
    # Issue 36: Horovod's MNIST example with hvd.DistributedOptimizer swapped for
    # PowerSGD's, seed 46, warned at step 70 under the earlier rule (gradients and
    # errors grow 1.5-2x in 20 steps while the network leaves its initialisation).
    # Three epochs, 141 steps: four checks after SETTLE_STEPS count.
    with open(HOROVOD_MNIST) as f:
        source = f.read().replace(
            "hvd.DistributedOptimizer(", '__import__("horovod_powersgd").DistributedOptimizer('
        )
    module = {"__name__": "horovod_style_mnist_swapped", "__file__": HOROVOD_MNIST}
    exec(compile(source, HOROVOD_MNIST, "exec"), module)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = module["main"](["--seed", "46", "--epochs", "3", "--log-interval", "1000"])
    assert result["optimizer"].compression_stats()["steps"] == 141
    assert result["train_loss"] < result["first_loss"]  # it learned
    growth = [str(w.message) for w in caught if issubclass(w.category, hps.ErrorGrowthWarning)]
    assert growth == []


# --- TensorBoard in the examples --------------------------------------------------------------
TINY = ["--epochs", "1", "--max-steps", "20", "--no-progress", "--seed", "3"]
EXAMPLES = {
    "fashion_mnist": (
        fashion_mnist.main,
        ["--powersgd-rank", "2", "--train-subset", "1280", "--eval-subset", "100",
         "--batch-size", "16"],
        ("test/loss", "test/accuracy"),
    ),
    "lstm": (
        lstm_language_model.main,
        ["--powersgd-rank", "4", "--train-subset", "20000", "--eval-subset", "2000",
         "--batch-size", "4", "--bptt", "10", "--size", "32", "--vocab-size", "2000"],
        ("valid/perplexity", "test/perplexity"),
    ),
    "transformer": (
        transformer_lm.main,
        ["--powersgd-rank", "4", "--train-subset", "20000", "--eval-subset", "2000",
         "--batch-size", "4", "--block", "10", "--size", "32", "--layers", "1", "--heads", "2",
         "--vocab-size", "2000", "--warmup-steps", "2", "--start-iter", "0"],
        ("valid/perplexity", "test/perplexity"),
    ),
}  # fmt: skip


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_examples_write_tensorboard_scalars_on_rank_0(tmp_path, example):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    main, args, epoch_tags = EXAMPLES[example]
    logdir = tmp_path / "tb"
    record = main([*TINY, *args, "--tensorboard", str(logdir)])
    if hvd.rank() != 0:
        assert not logdir.exists()  # only rank 0 writes
        return
    events = EventAccumulator(str(logdir))
    events.Reload()
    scalars = events.Tags()["scalars"]
    config = hps.PowerSGDConfig(rank=int(args[1]))
    compressed = [n for n, p in record["model"].named_parameters() if config.compresses(p.shape)]
    assert compressed
    every_10 = ["train/loss", "comm/bytes_sent", "comm/compression_ratio"]
    every_10 += [
        f"{kind}/{name}" for name in compressed for kind in ("relative_error", "error_ratio")
    ]
    for tag in every_10:
        assert [e.step for e in events.Scalars(tag)] == [10, 20], tag
    for tag in epoch_tags:
        assert [e.step for e in events.Scalars(tag)] == [20], tag
    assert set(scalars) == set(every_10) | set(epoch_tags)
    bytes_sent = events.Scalars("comm/bytes_sent")[-1].value
    assert bytes_sent == pytest.approx(record["final"]["bytes_sent"], rel=1e-6)
    for name in compressed:
        assert 0 < events.Scalars(f"relative_error/{name}")[-1].value < 1


def test_rank_auto_writes_the_chosen_ranks_to_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    main, args, _ = EXAMPLES["fashion_mnist"]
    args = [a if a != "2" else "auto" for a in args] + ["--powersgd-link", "10mbit"]
    logdir = tmp_path / "tb"
    record = main([*TINY, *args, "--tensorboard", str(logdir)])
    if hvd.rank() != 0:
        return
    events = EventAccumulator(str(logdir))
    events.Reload()
    names = [n for n, _ in record["model"].named_parameters()]
    tags = [f"rank/{n}" for n in names]
    assert set(tags) <= set(events.Tags()["scalars"])
    final = {tag: events.Scalars(tag)[-1].value for tag in tags}
    # Each layer's rank (capped at its matrix's min(n, m)); 10 Mbit/s: some compress.
    assert all(v == int(v) and 0 <= v <= 16 for v in final.values()), final
    assert any(final.values()), final
