"""AdamW on a small transformer (examples/transformer_lm.py): what users of today's models rely on.

Adam keeps a step count and two moments per parameter; they must stay equal on
every rank, survive Horovod's rank-0 resume and our checkpoints, and see the
same averaged gradient Horovod would give at full rank. Every rank runs every
test (see conftest.py).
"""

import copy
import os
import sys
import warnings

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from helpers import assert_same_on_every_rank
from torch import nn

import horovod_powersgd as hps

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import transformer_lm

VOCAB, SIZE, BLOCK = 50, 16, 8
# Every matrix of the tiny model: tokens 50x16, positions 8x16, qkv 48x16, proj 16x16,
# MLP 64x16 and 16x64. Rank 64 reaches every one's full rank.
FULL_RANK = 64


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return transformer_lm.TransformerLM(VOCAB, SIZE, 2, 2, BLOCK, dropout=0.0)


def adamw(model, **powersgd):
    opt = torch.optim.AdamW(transformer_lm.parameter_groups(model, 0.1), lr=1e-2)
    return hps.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **powersgd)


def loss_of(model, step):
    """Different tokens on every rank and step, reproducible."""
    g = torch.Generator().manual_seed(1000 * step + hvd.rank())
    tokens = torch.randint(0, VOCAB, (4, BLOCK + 1), generator=g)
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def train(model, opt, steps, first_step=0):
    """The example's step: clip the averaged gradient between synchronize() and step()."""
    for step in range(first_step, first_step + steps):
        opt.zero_grad()
        loss_of(model, step).backward()
        opt.synchronize()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with opt.skip_synchronize():
            opt.step()


def adam_state(model, opt):
    """{parameter name: {'step', 'exp_avg', 'exp_avg_sq'}}, cloned."""
    return {
        name: {k: v.clone() for k, v in opt.state[p].items()}
        for name, p in model.named_parameters()
    }


def assert_adam_state_equal(actual, expected):
    assert actual.keys() == expected.keys()
    for name, state in expected.items():
        assert set(actual[name]) == {"step", "exp_avg", "exp_avg_sq"}, name
        for key, tensor in state.items():
            assert torch.equal(actual[name][key], tensor), (name, key)


def assert_adam_state_same_on_every_rank(state):
    for name, tensors in state.items():
        for key, tensor in tensors.items():
            assert_same_on_every_rank(tensor, f"adam.{name}.{key}")


def test_full_rank_adamw_gets_horovods_average_and_stays_identical_on_every_rank():
    model = tiny_model()
    opt = adamw(model, rank=FULL_RANK, min_compression_rate=0)
    compressed = set(opt.compressor.compressed_names)
    assert compressed == {n for n, p in model.named_parameters() if p.dim() == 2}
    reference = tiny_model()
    for step in range(5):
        # Horovod's average of this rank's gradient, at the same weights.
        reference.load_state_dict(model.state_dict())
        reference.zero_grad()
        loss_of(reference, step).backward()
        names, grads = zip(*((n, p.grad) for n, p in reference.named_parameters()))
        averaged = dict(
            zip(names, hvd.grouped_allreduce(list(grads), op=hvd.Average, name=f"tf.full.{step}"))
        )
        opt.zero_grad()
        loss_of(model, step).backward()
        opt.synchronize()
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, averaged[n], rtol=1e-4, atol=1e-6, msg=n)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with opt.skip_synchronize():
            opt.step()
    assert opt.compression_stats()["steps"] == 5
    for n, p in model.named_parameters():
        assert_same_on_every_rank(p, n)
    state = adam_state(model, opt)
    assert all(s["step"].item() == 5 for s in state.values())
    assert_adam_state_same_on_every_rank(state)


def trained_and_saved():
    """4 steps of AdamW + PowerSGD; (what rank 0 would have saved, rank 0's Adam state)."""
    model = tiny_model()
    opt = adamw(model, rank=2, start_iter=2)
    train(model, opt, steps=4)
    saved = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    return saved, hvd.broadcast_object(adam_state(model, opt), root_rank=0, name="tf.saved")


def rank0_loads(saved):
    """A fresh model and optimizer; rank 0 alone loads `saved`, as Horovod's examples do."""
    model = tiny_model(seed=7)
    opt = adamw(model, rank=2, start_iter=2)
    if hvd.rank() == 0:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
    return model, opt


def train_after_rank0_resume(model, opt, steps):
    """Trains on from step 4; returns the warnings' texts (every rank gives the same)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(model, opt, steps=steps, first_step=4)
    return [str(w.message) for w in caught]


def test_horovods_rank0_resume_gives_every_rank_adams_saved_state():
    saved, root_saved = trained_and_saved()
    resumed, resumed_opt = rank0_loads(saved)
    # The optimizer state first: a rank without AdamW state gets one from a step on zero
    # gradients inside broadcast_optimizer_state, whose weight decay moves its weights;
    # the weights broadcast after it (examples/transformer_lm.py does the same).
    hvd.broadcast_optimizer_state(resumed_opt, root_rank=0)
    hvd.broadcast_parameters(resumed.state_dict(), root_rank=0)
    assert_adam_state_equal(adam_state(resumed, resumed_opt), root_saved)
    for group, saved_group in zip(
        resumed_opt.param_groups, saved["optimizer"]["param_groups"], strict=True
    ):
        assert (group["lr"], group["betas"], group["weight_decay"]) == (
            saved_group["lr"], saved_group["betas"], saved_group["weight_decay"]
        )  # fmt: skip

    messages = train_after_rank0_resume(resumed, resumed_opt, steps=3)
    # The other ranks take rank 0's PowerSGD state (their residuals start at zero);
    # nothing had drifted at the check after the first step.
    assert messages == [
        f"rank(s) {list(range(1, hvd.size()))} took the PowerSGD state of rank 0 (step 4): "
        "their error buffers start at zero"
    ]
    state = adam_state(resumed, resumed_opt)
    assert all(s["step"].item() == 7 for s in state.values()), "Adam's count goes on from 4"
    assert resumed_opt.powersgd_step == 7
    assert_adam_state_same_on_every_rank(state)
    for n, p in resumed.named_parameters():
        assert torch.isfinite(p).all(), n
        assert_same_on_every_rank(p, n)


def test_weights_moved_by_broadcast_optimizer_state_are_repaired_after_the_first_step():
    """Horovod's own order (weights, then state) with weight decay: rank 0's weights win."""
    saved, root_saved = trained_and_saved()
    resumed, resumed_opt = rank0_loads(saved)
    hvd.broadcast_parameters(resumed.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(resumed_opt, root_rank=0)
    assert_adam_state_equal(adam_state(resumed, resumed_opt), root_saved)
    decayed = transformer_lm.parameter_groups(resumed, 0.1)[0]["params"]
    moved = hvd.allgather(
        torch.cat([p.detach().flatten() for p in decayed]).view(1, -1), name="tf.moved"
    )
    assert all(not torch.equal(moved[r], moved[0]) for r in range(1, hvd.size())), (
        "broadcast_optimizer_state no longer moves the weights of ranks without state: "
        "the example's order and this test can be revisited"
    )

    messages = train_after_rank0_resume(resumed, resumed_opt, steps=2)
    assert len(messages) == 2 and "took the PowerSGD state of rank 0" in messages[0]
    # The first step after the ranks agreed checks, whatever drift_check_every (100 here).
    assert messages[1].startswith("parameters differed across ranks at step 5 and were reset")
    assert "blocks.0.attention.qkv.weight" in messages[1]
    for n, p in resumed.named_parameters():
        assert_same_on_every_rank(p, n)
    assert_adam_state_same_on_every_rank(adam_state(resumed, resumed_opt))


def test_save_and_load_checkpoint_resume_adamw_bit_for_bit(shared_dir):
    path = os.path.join(shared_dir, "ckpt.pt")
    model = tiny_model()
    opt = adamw(model, rank=2, start_iter=2)
    train(model, opt, steps=4)
    hps.save_checkpoint(path, model, opt, epoch=1)
    saved = adam_state(model, opt)
    train(model, opt, steps=4, first_step=4)  # the run that never stopped

    resumed = tiny_model(seed=7)
    resumed_opt = adamw(resumed, rank=2, start_iter=2)
    assert hps.load_checkpoint(path, resumed, resumed_opt) == {"epoch": 1}
    assert_adam_state_equal(adam_state(resumed, resumed_opt), saved)
    train(resumed, resumed_opt, steps=4, first_step=4)
    for (n, a), b in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), n
    assert_adam_state_equal(adam_state(resumed, resumed_opt), adam_state(model, opt))
    assert resumed_opt.compression_stats() == opt.compression_stats()
