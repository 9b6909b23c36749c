"""What Horovod users do in ordinary scripts: rank-0 resume, fp16 on the wire,
AMP loss scaling, gradients edited before step(), accumulation, synchronize().

Every rank runs every test (see conftest.py).
"""

import gc
import re
import warnings

import helpers
import horovod.torch as hvd
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same_on_every_rank, batch, make_model, powersgd, train
from torch import nn

import horovod_powersgd as hps
from horovod_powersgd import reducer as reducer_module


# --- Horovod's usual resume: rank 0 loads, then broadcasts ----------------------------------
def test_rank0_load_then_broadcast_optimizer_state_resumes_on_every_rank():
    model = make_model()
    opt = powersgd(model, rank=2, start_iter=5)
    train(model, opt, steps=4)
    saved = {"model": model.state_dict(), "optimizer": opt.state_dict()}

    resumed = make_model(seed=7)
    resumed_opt = powersgd(resumed, rank=2, start_iter=5)
    if hvd.rank() == 0:  # the pattern of Horovod's examples: only rank 0 reads the file
        resumed.load_state_dict(saved["model"])
        resumed_opt.load_state_dict(saved["optimizer"])
    hvd.broadcast_parameters(resumed.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(resumed_opt, root_rank=0)
    # The first step agrees on rank 0's step counter (4), Q memory and RNG before
    # its first collective: step 4 is plain on every rank, 5-7 compressed, no stall.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(resumed, resumed_opt, steps=4, first_step=4)
    took_over = [w for w in caught if "error buffers start at zero" in str(w.message)]
    train(model, opt, steps=4, first_step=4)
    for n, p in resumed.named_parameters():
        assert_same_on_every_rank(p, n)
        assert torch.isfinite(p).all()
    for n, q in resumed_opt.compressor.state_dict()["q_memory"].items():
        assert_same_on_every_rank(q, f"q.{n}")
    assert resumed_opt.powersgd_step == opt.powersgd_step == 8
    # Every rank says alike which ranks dropped their residuals (all but the root).
    assert len(took_over) == 1, [str(w.message) for w in caught]
    assert f"rank(s) {list(range(1, hvd.size()))} took" in str(took_over[0].message)


def test_broadcast_optimizer_state_without_a_load_changes_nothing_and_warns_nothing():
    model = make_model()
    opt = powersgd(model, rank=2)
    train(model, opt, steps=3)
    errors = {k: v.clone() for k, v in opt.compressor.state_dict()["error_buffers"].items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    after = opt.compressor.state_dict()["error_buffers"]
    assert all(torch.equal(errors[k], after[k]) for k in errors)  # residuals kept


# --- fp16 on the wire keeps the gradient's scale -------------------------------------------
def _aggregate(layer, opt, grad):
    layer.weight.grad = grad.to(layer.weight.device, copy=True)
    opt.synchronize()
    return layer.weight.grad.clone()


@pytest.mark.parametrize("rounds", [2, 1])
@pytest.mark.parametrize("scale", [1e-5, 1e-3, 1.0, 1e3])
def test_fp16_on_the_wire_stays_within_one_percent_of_float32(scale, rounds):
    torch.manual_seed(0)
    layers = {d: nn.Linear(128, 64, bias=False).to(helpers.DEVICE) for d in (None, torch.float16)}
    opts = {
        dtype: hps.DistributedOptimizer(
            torch.optim.SGD(layer.parameters(), lr=0.1),
            named_parameters=layer.named_parameters(),
            rank=4,
            rounds=rounds,
            comm_dtype=dtype,
        )
        for dtype, layer in layers.items()
    }
    g = torch.Generator().manual_seed(hvd.rank())
    # A gradient with a few strong directions plus noise, like a real layer's.
    basis_u, basis_v = torch.randn(64, 3, generator=g), torch.randn(3, 128, generator=g)
    for step in range(6):  # warm-started steps are where the scale used to be lost
        grad = scale * (basis_u @ basis_v + 0.3 * torch.randn(64, 128, generator=g))
        result = {dtype: _aggregate(layers[dtype], opts[dtype], grad) for dtype in layers}
        reference = result[None]
        error = (result[torch.float16] - reference).norm() / reference.norm()
        assert torch.isfinite(result[torch.float16]).all(), (scale, step)
        assert error < 0.01, (scale, step, float(error))


def _skipped_steps(comm_dtype, rounds):
    model = make_model()
    opt = powersgd(model, rank=2, comm_dtype=comm_dtype, rounds=rounds)
    scaler = torch.amp.GradScaler(helpers.DEVICE.type, init_scale=65536.0, growth_interval=10_000)
    skipped = 0
    for step in range(12):
        x, y = batch(step)
        opt.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        before = scaler.get_scale()
        scaler.update()
        skipped += scaler.get_scale() < before
    return skipped, model


@pytest.mark.parametrize("rounds", [2, 1])
def test_grad_scaler_skips_no_more_steps_with_fp16_on_the_wire(rounds):
    skipped32, _ = _skipped_steps(None, rounds)
    skipped16, model = _skipped_steps(torch.float16, rounds)
    assert skipped16 <= skipped32, (skipped16, skipped32)
    for n, p in model.named_parameters():
        assert torch.isfinite(p).all()
        assert_same_on_every_rank(p, n)


# --- gradients edited between backward() and step() ----------------------------------------
@pytest.mark.parametrize("rounds", [2, 1])
def test_gradient_replaced_before_step_gets_the_aggregate_like_horovod(rounds, monkeypatch):
    monkeypatch.setattr(reducer_module, "BUCKET_BYTES", 2048)  # several buckets
    grads = {}
    for kind in ("horovod", "powersgd"):
        model = make_model()
        sgd = torch.optim.SGD(model.parameters(), lr=0.05)
        if kind == "horovod":
            opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
        else:  # full rank: PowerSGD's aggregate equals Horovod's average
            opt = hps.DistributedOptimizer(
                sgd,
                named_parameters=model.named_parameters(),
                rank=64,
                min_compression_rate=0,
                rounds=rounds,
            )
        x, y = batch(0)
        F.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            p.grad = p.grad.clamp(-0.01, 0.01)  # a new tensor, after the hooks fired
        opt.synchronize()
        grads[kind] = [p.grad.clone() for p in model.parameters()]
        for n, p in model.named_parameters():
            assert_same_on_every_rank(p.grad, f"{kind}.{n}")
    for ours, theirs in zip(grads["powersgd"], grads["horovod"]):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)


def test_zero_grad_between_micro_batches_raises_like_horovod():
    model = make_model()
    opt = powersgd(model, rank=2, backward_passes_per_step=2)
    x, y = batch(0)
    F.cross_entropy(model(x), y).backward()  # first of two micro-batches
    with pytest.raises(AssertionError, match="zero_grad"):
        opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert opt.compression_stats()["steps"] == 1
    opt.zero_grad()  # after the step it is fine again


def test_step_after_synchronize_without_skip_equals_the_skip_synchronize_step():
    params = []
    for skip in (True, False):
        model = make_model()
        opt = powersgd(model, rank=2)
        for step in range(3):
            x, y = batch(step)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            if skip:
                with opt.skip_synchronize():
                    opt.step()
            else:
                with pytest.warns(UserWarning, match="already aggregated"):
                    opt.step()
        assert opt.compression_stats()["steps"] == 3  # no second round
        params.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*params):
        assert torch.equal(a, b)


# --- a layer frozen in the middle of training (issue 23, item 5) ------------------------------
@pytest.mark.parametrize("rounds", [2, 1])
def test_a_layer_frozen_mid_training_stays_where_it_is_like_horovod(rounds):
    model = make_model()
    opt = hps.DistributedOptimizer(  # no momentum, no weight decay: a zero gradient moves nothing
        torch.optim.SGD(model.parameters(), lr=0.05),
        named_parameters=model.named_parameters(),
        rank=2,
        rounds=rounds,
    )
    train(model, opt, steps=5)  # the first layer now carries a residual
    name = "0.weight"
    assert opt.compressor.state_dict()["error_buffers"][name].abs().sum() > 0
    model[0].requires_grad_(False)
    frozen = [p.detach().clone() for p in model[0].parameters()]
    train(model, opt, steps=20, first_step=5)
    for before, p in zip(frozen, model[0].parameters()):
        assert torch.equal(before, p)
    assert torch.equal(
        opt.compressor.state_dict()["error_buffers"][name],
        torch.zeros_like(model[0].weight),
    )
    # The other layers trained on, identical on every rank.
    for n, p in model.named_parameters():
        assert_same_on_every_rank(p, n)
    # Unfrozen, the layer trains again.
    model[0].requires_grad_(True)
    train(model, opt, steps=2, first_step=25)
    assert not torch.equal(frozen[0], model[0].weight)


# --- parameters the optimizer did not know when it was wrapped (issue 52, item 4) -------------
NEW_PARAMETERS = "horovod_powersgd averages only the parameters that require grad"


def _trunk_optimizer(model, rank):
    """SGD over the first layers only: the head is the model's, not the optimizer's (yet)."""
    trunk = [p for n, p in model.named_parameters() if not n.startswith("4.")]
    return hps.DistributedOptimizer(
        torch.optim.SGD(trunk, lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(),
        rank=rank,
    )


@pytest.mark.parametrize("rank", [2, "auto"])
@pytest.mark.parametrize("steps_before", [0, 2], ids=["before-step-1", "after-step-2"])
def test_add_param_group_after_wrapping_is_refused_naming_the_parameters(steps_before, rank):
    # A head added to the optimizer mid-run would train on each rank's own gradients
    # (Horovod drops it as silently). Refused at the call, on every rank alike (the
    # same code runs on every rank), naming the parameters; nothing changes, and the
    # run goes on as before.
    model = make_model()
    opt = _trunk_optimizer(model, rank)
    train(model, opt, steps=steps_before)
    sent = opt.compression_stats()["elements_sent"]
    with pytest.raises(ValueError, match=NEW_PARAMETERS) as refused:
        opt.add_param_group({"params": model[4].parameters(), "lr": 0.01})
    assert "add_param_group() after the optimizer was wrapped" in str(refused.value)
    assert "'4.weight', '4.bias'" in str(refused.value)
    assert "requires_grad_(False)" in str(refused.value)  # and what to do instead
    assert len(opt.param_groups) == 1 and opt.compression_stats()["elements_sent"] == sent
    head = [p.detach().clone() for p in model[4].parameters()]
    train(model, opt, steps=2, first_step=steps_before)
    for before, p in zip(head, model[4].parameters()):
        assert torch.equal(before, p)  # still not the optimizer's
    for n, p in model.named_parameters():
        assert_same_on_every_rank(p, n)


def test_a_parameter_frozen_when_wrapped_then_unfrozen_is_refused_at_the_next_step():
    # Frozen when wrapped: no hook, no bucket, no drift check. Unfrozen later, it
    # would train on each rank's own gradients; its next step raises on every rank
    # before any collective, naming it, and leaves the optimizer ready to go on.
    model = make_model()
    model[0].requires_grad_(False)
    opt = powersgd(model, drift_check_every=1)
    train(model, opt, steps=2)
    model[0].requires_grad_(True)
    sent = opt.compression_stats()["elements_sent"]
    with pytest.raises(ValueError, match=NEW_PARAMETERS) as refused:
        train(model, opt, steps=1, first_step=2)
    assert "did not require grad when the optimizer was wrapped now do" in str(refused.value)
    assert "'0.weight', '0.bias'" in str(refused.value)
    assert opt.compression_stats()["elements_sent"] == sent
    assert opt.powersgd_step == 2
    model[0].requires_grad_(False)  # frozen again, the run goes on
    train(model, opt, steps=2, first_step=2)
    for n, p in model.named_parameters():
        assert_same_on_every_rank(p, n)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("where", ["every-rank", "rank-1"])
def test_a_parameter_put_into_param_groups_by_hand_is_refused_at_the_drift_check(where):
    # Not through add_param_group: seen at the next drift check, in its all-gather,
    # so every rank raises alike even where only rank 1 did it (no rank left waiting).
    model = make_model()
    opt = _trunk_optimizer(model, 2)
    if where == "every-rank" or hvd.rank() == 1:
        opt.param_groups[0]["params"].append(model[4].weight)
    with pytest.raises(ValueError, match=NEW_PARAMETERS) as refused:
        train(model, opt, steps=1)  # the first step checks drift
    ranks = [0, 1] if where == "every-rank" else [1]
    assert f"since the optimizer was wrapped, on rank(s) {ranks}: " in str(refused.value)
    mine = "'4.weight'" if where == "every-rank" or hvd.rank() == 1 else "none on this rank"
    assert f"{ranks}: {mine}" in str(refused.value)


@pytest.mark.parametrize("rounds", [2, 1])
def test_a_backbone_wrapped_trainable_frozen_then_unfrozen_trains_averaged(rounds):
    # What the refusals advise: every parameter requires grad when the optimizer is
    # wrapped; frozen after, unfrozen later, it is averaged like any other.
    model = make_model()
    opt = powersgd(model, rounds=rounds)
    model[0].requires_grad_(False)
    train(model, opt, steps=3)
    frozen = model[0].weight.detach().clone()
    model[0].requires_grad_(True)
    train(model, opt, steps=3, first_step=3)
    assert not torch.equal(frozen, model[0].weight)
    for n, p in model.named_parameters():
        assert_same_on_every_rank(p, n)


def test_a_new_optimizer_on_the_same_model_replaces_the_old_one_without_gc():
    # Scripts that try settings one after another build a new optimizer on the
    # same model and drop the old one. Its hooks hold it weakly; nothing else may
    # hold it in a cycle, or its hooks go on counting backward passes (and raise).
    gc_was = gc.isenabled()
    gc.disable()  # the old one must go by reference counting alone
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        for rounds in (2, 1, 2):
            sgd = torch.optim.SGD(model.parameters(), lr=0.01)
            opt = hps.DistributedOptimizer(
                sgd, named_parameters=model.named_parameters(), rank=2, rounds=rounds
            )
            for _ in range(2):
                opt.zero_grad()
                model(torch.randn(8, 16)).pow(2).mean().backward()
                opt.step()
    finally:
        if gc_was:
            gc.enable()


def test_an_older_optimizer_still_referenced_is_named_as_the_cause():
    # Wrapped with the backbone frozen, then unfrozen and wrapped again over every
    # parameter, while an LR scheduler still holds the first optimizer: its hooks still
    # fire. It is named as the cause (not told to do what the user just did), on every
    # rank, before any collective; dropped, the new optimizer trains on.
    model = make_model()
    model[0].requires_grad_(False)
    head = powersgd(model)
    scheduler = torch.optim.lr_scheduler.StepLR(head, step_size=10)
    train(model, head, steps=2)
    model[0].requires_grad_(True)
    everything = powersgd(model)
    with pytest.raises(RuntimeError, match="older optimizer is the cause") as refused:
        train(model, everything, steps=1, first_step=2)
    message = str(refused.value)
    assert "did not require grad" not in message, message
    assert re.search(r"parameter '[24]\.(weight|bias)' is wrapped by two", message), message
    assert "this older one (SGD, over 4 parameters)" in message, message
    del scheduler, head, refused  # (its traceback holds both optimizers too)
    everything = powersgd(model)  # the user's fix: nothing holds the old one now
    train(model, everything, steps=2, first_step=3)
    for n, p in model.named_parameters():
        assert_same_on_every_rank(p, f"superseded.{n}")
