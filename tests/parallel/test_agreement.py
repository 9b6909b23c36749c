"""Ranks agree on what must be equal: the shared PowerSGD state after a rank-local
load, and the parameters themselves when ranks round differently.

Every rank runs every test (see conftest.py).
"""

import warnings

import horovod.torch as hvd
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same_on_every_rank, batch, make_model, train
from torch import nn

import horovod_powersgd as hps

TOOK_OVER = "took the PowerSGD state of rank 0"
DRIFTED = "parameters differed across ranks"


def sgd(model, momentum=0.0, **kwargs):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    return hps.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **kwargs)


def train_recording_warnings(model, opt, steps, first_step=0, dtype=torch.float32):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(model, opt, steps=steps, first_step=first_step, dtype=dtype)
    return [str(w.message) for w in caught]


# --- rank-0 resume without hvd.broadcast_optimizer_state (issue 23, item 2) -----------------
@pytest.mark.parametrize(
    "kwargs", [{"start_iter": 3}, {"rounds": 1}, {}], ids=["start_iter3", "rounds1", "default"]
)
def test_rank0_load_then_only_broadcast_parameters_agrees_before_the_next_step(kwargs):
    # SGD without momentum has no optimizer state, so Horovod's scripts often load on
    # rank 0 and broadcast only the parameters. Ranks then disagree on the step counter
    # (warm-up or not, the rounds=1 phase), Q memory and RNG until the first step agrees.
    model = make_model()
    opt = sgd(model, **kwargs)
    train(model, opt, steps=5)  # start_iter=3: steps 3-4 compressed; rounds=1: next is odd
    saved = {"model": model.state_dict(), "optimizer": opt.state_dict()}

    resumed = make_model(seed=7)
    resumed_opt = sgd(resumed, **kwargs)
    if hvd.rank() == 0:
        resumed.load_state_dict(saved["model"])
        resumed_opt.load_state_dict(saved["optimizer"])
    hvd.broadcast_parameters(resumed.state_dict(), root_rank=0)
    messages = train_recording_warnings(resumed, resumed_opt, steps=4, first_step=5)

    assert resumed_opt.powersgd_step == 9
    assert_same_on_every_rank(torch.tensor([resumed_opt.powersgd_step]), "step")
    for n, p in resumed.named_parameters():
        assert torch.isfinite(p).all(), n
        assert_same_on_every_rank(p, n)
    for kind in ("q_memory", "p_memory") if kwargs.get("rounds") == 1 else ("q_memory",):
        for n, t in resumed_opt.compressor.state_dict()[kind].items():
            assert_same_on_every_rank(t, f"{kind}.{n}")
    # Every rank warns alike, once, which ranks dropped their residuals.
    took_over = [m for m in messages if TOOK_OVER in m]
    assert len(took_over) == 1, messages
    assert f"rank(s) {list(range(1, hvd.size()))} took" in took_over[0]
    # Rank 0 kept its own restored state: its residuals equal the saved ones.
    if hvd.rank() == 0:
        assert resumed_opt.compression_stats()["steps"] == 9


def test_a_fresh_optimizer_agrees_silently_and_costs_one_small_collective_once():
    model = make_model()
    opt = sgd(model)
    calls = []
    real = hvd.allgather

    def counting(tensor, *args, **kwargs):
        calls.append(kwargs.get("name", ""))
        return real(tensor, *args, **kwargs)

    hvd_allgather, hvd.allgather = hvd.allgather, counting
    try:
        messages = train_recording_warnings(model, opt, steps=3)
    finally:
        hvd.allgather = hvd_allgather
    assert not messages
    assert [c for c in calls if c.endswith(".agree")] == [f"{opt.powersgd_state.comm.name}.agree"]


# --- parameters that drift apart (issue 23, item 3) -----------------------------------------
@pytest.mark.world_size(2)
def test_drift_between_ranks_is_found_and_repaired_with_a_warning_on_every_rank():
    model = make_model()
    opt = sgd(model, momentum=0.9, drift_check_every=4)
    train(model, opt, steps=2)
    if hvd.rank() == 1:  # what a processor that rounds differently does, in one step
        with torch.no_grad():
            model[2].weight[0, 0] = torch.nextafter(model[2].weight[0, 0], torch.tensor(1.0))
            opt.state[model[0].weight]["momentum_buffer"][3, 3] += 1e-7
    messages = train_recording_warnings(model, opt, steps=1, first_step=2)  # step 3: no check
    assert not messages
    if hvd.rank() == 1:  # still different: the check has not run
        assert not torch.equal(model[2].weight, hvd.broadcast(model[2].weight, 0, name="w0"))
    else:
        hvd.broadcast(model[2].weight, 0, name="w0")
    messages = train_recording_warnings(model, opt, steps=1, first_step=3)  # step 4: check
    drifted = [m for m in messages if DRIFTED in m]
    assert len(drifted) == 1, messages
    assert "'2.weight'" in drifted[0] and "'0.weight'" in drifted[0]
    for n, p in model.named_parameters():
        assert_same_on_every_rank(p, n)
        assert_same_on_every_rank(opt.state[p]["momentum_buffer"], f"momentum.{n}")
    assert opt.powersgd_state.guard.repairs == 1


@pytest.mark.world_size(2)
def test_ranks_with_different_thread_counts_are_identical_after_every_check():
    # Rank 0 with one BLAS thread, rank 1 with two: matrix products may round
    # differently, so the ranks' rebuilt gradients may differ in their last bits.
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if hvd.rank() == 0 else 2)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
        opt = hps.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            named_parameters=model.named_parameters(),
            rank=4,
            drift_check_every=5,
        )
        for step in range(10):
            g = torch.Generator().manual_seed(100 * step + hvd.rank())
            x = torch.randn(64, 256, generator=g)
            opt.zero_grad()
            (model(x) - x).pow(2).mean().backward()
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", DRIFTED)
                opt.step()
            if (step + 1) % 5 == 0:  # after a check: identical, whatever the rounding did
                for n, p in model.named_parameters():
                    assert_same_on_every_rank(p, f"{step}.{n}")
        assert opt.powersgd_state.guard.checks == 3  # after the first step, then steps 5 and 10
    finally:
        torch.set_num_threads(threads)


def test_drift_check_every_zero_never_checks_and_bad_values_raise():
    model = make_model()
    opt = sgd(model, drift_check_every=0)
    train(model, opt, steps=3)
    assert opt.powersgd_state.guard.checks == 0
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="drift_check_every"):
            sgd(model, drift_check_every=bad)


def nudge(tensor, index, direction):
    """Move one element of `tensor` by one ulp (bits +1 or -1 for a positive float)."""
    flat = tensor.data.view(-1)
    target = torch.tensor(float("inf") if direction > 0 else 0.0, dtype=tensor.dtype)
    flat[index] = torch.nextafter(flat[index : index + 1], target.view(1))[0]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opposite_one_ulp_changes_are_found_and_repaired(dtype):
    # +1 and -1 in the bit patterns of two elements: a plain sum of the bits cancels.
    model = make_model(dtype=dtype)
    opt = sgd(model, momentum=0.9, drift_check_every=1)
    train(model, opt, steps=2, dtype=dtype)
    weight = model[2].weight
    positive = (weight.detach().view(-1) > 0).nonzero().view(-1)
    if hvd.rank() == 1:
        with torch.no_grad():
            nudge(weight, int(positive[3]), +1)
            nudge(weight, int(positive[40]), -1)
    messages = train_recording_warnings(model, opt, steps=1, first_step=2, dtype=dtype)
    drifted = [m for m in messages if DRIFTED in m]
    assert len(drifted) == 1 and "'2.weight'" in drifted[0], messages
    for n, p in model.named_parameters():
        assert_same_on_every_rank(p, n)
        assert_same_on_every_rank(opt.state[p]["momentum_buffer"], f"momentum.{n}")


class SGDWithMask(torch.optim.SGD):
    """SGD that keeps a bool tensor of odd length per parameter, as custom optimizers may."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                mask = self.state[p].setdefault("seen", torch.zeros(3, dtype=torch.bool))
                mask[0] = True
        return super().step(closure)


@pytest.mark.world_size(2)
def test_odd_sized_one_byte_optimizer_state_is_checked_and_repaired():
    model = make_model()
    opt = hps.DistributedOptimizer(
        SGDWithMask(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(),
        drift_check_every=1,
    )
    train(model, opt, steps=2)
    if hvd.rank() == 1:
        opt.state[model[0].weight]["seen"][2] = True
    messages = train_recording_warnings(model, opt, steps=1, first_step=2)
    drifted = [m for m in messages if DRIFTED in m]
    assert len(drifted) == 1 and "'0.weight'" in drifted[0], messages
    seen = opt.state[model[0].weight]["seen"]
    assert seen.tolist() == [True, False, False]  # rank 0's, on every rank
    assert_same_on_every_rank(seen.to(torch.uint8), "seen")


def test_optimizer_state_of_another_layout_on_one_rank_raises_at_the_check_on_every_rank():
    model = make_model()
    opt = sgd(model, momentum=0.9, drift_check_every=2)
    train(model, opt, steps=1)
    if hvd.rank() == 1:  # a state the other ranks do not have (another optimizer's)
        opt.state[model[0].weight]["max_exp_avg_sq"] = torch.zeros(64, 32)
    with pytest.raises(ValueError, match=r"optimizer state of parameter '0.weight'.*other"):
        train(model, opt, steps=1, first_step=1)


def _one_ulp_up(value: float) -> torch.Tensor:
    return torch.nextafter(torch.tensor(value), torch.tensor(1.0))


SETTINGS = "the wrapped optimizer's settings differed across ranks"


@pytest.mark.world_size(2)
@pytest.mark.parametrize(
    ("setting", "make"),
    [
        ("amsgrad", lambda params, rank: torch.optim.AdamW(params, lr=1e-3, amsgrad=rank == 1)),
        ("momentum", lambda params, rank: torch.optim.SGD(params, lr=0.05, momentum=0.9 * rank)),
        (
            "lr",  # a tensor one ulp apart: its repr is the same on both ranks
            lambda params, rank: torch.optim.SGD(
                params, lr=_one_ulp_up(0.05) if rank else torch.tensor(0.05)
            ),
        ),
    ],
    ids=["amsgrad", "momentum", "tensor-lr"],
)
@pytest.mark.parametrize("layers", [1, 3], ids=["one-parameter", "mlp"])
def test_optimizer_settings_that_differ_at_the_first_step_become_rank0s_with_a_warning(
    setting, make, layers
):
    # Building them so is Horovod's normal path (hvd.broadcast_optimizer_state then
    # brings rank 0's); Horovod's own test_broadcast_state_options steps once before
    # that broadcast. The first step warns on every rank, naming the setting and the
    # ranks, and every rank steps with rank 0's settings from then on.
    torch.manual_seed(0)
    model = nn.Linear(8, 8, bias=False) if layers == 1 else make_model()
    opt = hps.DistributedOptimizer(
        make(model.parameters(), hvd.rank()), named_parameters=model.named_parameters()
    )
    rank0 = make([nn.Parameter(torch.zeros(1))], 0).param_groups[0][setting]
    x = torch.randn(4, 32)[:, : 8 if layers == 1 else 32]
    for step in range(3):
        opt.zero_grad()
        if step == 0:
            with pytest.warns(UserWarning, match=SETTINGS) as caught:
                model(x * (1 + hvd.rank())).sum().backward()
            message = str(next(w.message for w in caught if SETTINGS in str(w.message)))
            assert f"'{setting}' of param group 0" in message and "on rank(s) [1]" in message
            assert "Every rank now uses rank 0's" in message
        else:
            model(x * (1 + hvd.rank())).sum().backward()
        opt.step()
    mine = opt.param_groups[0][setting]
    assert type(mine) is type(rank0) and (
        torch.equal(mine, rank0) if torch.is_tensor(mine) else mine == rank0
    )
    for n, p in model.named_parameters():
        assert_same_on_every_rank(p, n)
        for key, value in opt.state[p].items():
            if torch.is_tensor(value):
                assert_same_on_every_rank(value, f"{n}.{key}")


@pytest.mark.world_size(2)
@pytest.mark.parametrize("kind", ["float", "tensor"])
def test_a_setting_changed_on_one_rank_mid_run_is_named_at_the_next_drift_check(kind):
    # A per-rank schedule: rank 1 halves its learning rate after step 3 (a float), or
    # nudges a tensor learning rate by one ulp. The drift check at step 5 names the
    # setting and the ranks, on every rank, and every rank goes on with rank 0's.
    model = make_model()
    lr = torch.tensor(0.05) if kind == "tensor" else 0.05
    opt = hps.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
        named_parameters=model.named_parameters(),
        drift_check_every=5,
    )
    train(model, opt, steps=3)
    if hvd.rank() == 1:
        group = opt.param_groups[0]
        if kind == "tensor":
            group["lr"].copy_(_one_ulp_up(0.05))
        else:
            group["lr"] = group["lr"] / 2
    messages = train_recording_warnings(model, opt, steps=2, first_step=3)  # step 5: a check
    named = [m for m in messages if SETTINGS in m]
    assert len(named) == 1, messages
    assert "at step 5" in named[0] and "'lr' of param group 0" in named[0], named[0]
    assert "on rank(s) [0]" in named[0] and "on rank(s) [1]" in named[0], named[0]
    if kind == "float":  # two steps at another lr: the parameters were repaired too
        assert any(DRIFTED in m for m in messages), messages
    group_lr = opt.param_groups[0]["lr"]
    assert_same_on_every_rank(torch.as_tensor(group_lr, dtype=torch.float64), "lr")
    if kind == "tensor":
        assert group_lr is lr  # taken over in place: a scheduler holding it sees it
    assert not train_recording_warnings(model, opt, steps=5, first_step=5)  # step 10: a check
    for n, p in model.named_parameters():
        assert_same_on_every_rank(p, n)


def test_a_skipped_first_step_after_a_resume_keeps_its_drift_check():
    # Rank 1's weights off by 1e-4 after a resume; the first step after it is skipped
    # on every rank (as GradScaler skips an overflow step): the check waits for the next.
    model = make_model()
    opt = hps.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        named_parameters=model.named_parameters(),
    )
    train(model, opt, steps=2)
    saved = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    resumed = make_model(seed=7)
    resumed_opt = hps.DistributedOptimizer(
        torch.optim.AdamW(resumed.parameters(), lr=1e-3),
        named_parameters=resumed.named_parameters(),
    )
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["optimizer"])
    if hvd.rank() == 1:
        with torch.no_grad():
            resumed[0].weight.add_(1e-4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x, y = batch(2)
        F.cross_entropy(resumed(x), y).backward()
        resumed_opt.synchronize()  # ... and no step(): skipped on every rank
        resumed_opt.zero_grad()
        train(resumed, resumed_opt, steps=1, first_step=3)
    drifted = [str(w.message) for w in caught if DRIFTED in str(w.message)]
    assert len(drifted) == 1 and "'0.weight'" in drifted[0]
    for n, p in resumed.named_parameters():
        assert_same_on_every_rank(p, n)


@pytest.mark.parametrize("rounds", [1, 2])
def test_rank0_reloading_mid_training_then_broadcast_optimizer_state_agrees(rounds):
    # Horovod's habit: rank 0 loads an earlier state while the others trained on,
    # then every rank calls hvd.broadcast_parameters and hvd.broadcast_optimizer_state.
    model = make_model()
    opt = sgd(model, momentum=0.9, rounds=rounds)
    train(model, opt, steps=5)
    saved = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    train(model, opt, steps=3, first_step=5)
    if hvd.rank() == 0:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    messages = train_recording_warnings(model, opt, steps=2, first_step=5)
    assert opt.powersgd_step == 7  # rank 0's 5, then 2 more, on every rank
    assert_same_on_every_rank(torch.tensor([opt.powersgd_step]), "step")
    for n, p in model.named_parameters():
        assert torch.isfinite(p).all(), n
        assert_same_on_every_rank(p, n)
    took_over = [m for m in messages if TOOK_OVER in m]
    assert len(took_over) == 1, messages


@pytest.mark.parametrize("rounds", [1, 2])
def test_rank_1_trains_from_the_first_step(rounds):
    # A rank-1 Q memory is m x 1 with a last stride of m: the first step's state
    # digest could not view it as bytes (issue 36).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 32, bias=False))
    opt = sgd(model, rank=1, rounds=rounds)
    for step in range(3):
        x, _ = batch(step)
        opt.zero_grad()
        model(x[:, :20]).pow(2).mean().backward()
        opt.step()
    assert opt.compression_stats()["ratio"] > 1
    assert_same_on_every_rank(model[0].weight, "rank1.weight")
