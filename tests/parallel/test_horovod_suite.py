"""What Horovod's own optimizer tests check, asserted here of this optimizer.

Horovod 0.28.1's ``test/parallel/test_torch.py`` checks its ``hvd.DistributedOptimizer``
in the tests below. Nothing of that file is copied here (its code stays in its own
repository): each test of this module asserts, with its own model and in its own
words, the property that a Horovod test relies on, with our
``horovod_powersgd.DistributedOptimizer`` (defaults: rank 2, so most matrices here
are compressed). Each docstring names the Horovod test it stands for.

Horovod test that builds a DistributedOptimizer -> the test here:

- ``test_broadcast_state`` -> `test_a_rank0_load_then_the_broadcasts_give_every_rank_rank0s_state`
- ``test_broadcast_state_options`` ->
  `test_options_built_differently_per_rank_are_rank0s_after_broadcast_optimizer_state`
  (built with each rank's own options, one step, the broadcast, one more step; the first
  step warns and takes rank 0's options: see
  `test_agreement.py::test_optimizer_settings_that_differ_at_the_first_step_become_rank0s_with_a_warning`)
- ``test_broadcast_state_no_grad`` -> `test_a_frozen_integer_parameter_survives_the_broadcasts`
- ``test_force_allreduce`` -> `test_a_parameter_unused_on_one_rank_still_gets_the_average`
- ``test_duplicate_names`` -> `test_duplicate_names_are_refused`
- ``test_missing_named_parameters`` -> `test_unnamed_parameters_are_refused`
- ``test_no_named_parameters`` -> `test_named_parameters_may_be_left_out`
- ``test_optimizer_no_named_parameters`` ->
  `test_parameter_names_name_every_parameter_alike_on_every_rank`
- ``test_dynamic_requires_grad`` -> `test_requires_grad_switched_between_two_optimizers`
- ``test_gradient_clipping`` -> `test_gradients_clipped_between_synchronize_and_step_are_applied`
- ``test_synchronize_step_warning`` -> `test_step_after_synchronize_without_skip_warns_once`
- ``test_sparse_embeddings`` -> `test_sparse_as_dense_trains_sparse_adam_as_horovod_does` and
  `test_sparse_as_dense_with_compressed_embeddings_trains_sparse_adam`, and as it is
  (both halves, Horovod's inputs) -> `test_sparse_embeddings`: without
  sparse_as_dense the sparse gradient is all-gathered, as Horovod does
  (more in tests/parallel/test_sparse.py).

Left out:

- ``test_broadcast_state_gpu``, ``test_model_parallelism``: need GPUs (the first is
  also skipped in Horovod); docs/gpu.md and ``make gpu-check`` cover GPUs.
- ``test_delta_optimizer``: ``op=hvd.Adasum`` on GPUs. Adasum is not linear, so P
  and Q cannot be summed: this optimizer refuses it with a ValueError
  (`test_optimizer.py`, the bad-arguments test).

Horovod's optimizer tests over process sets live in other files of its suite;
`test_process_sets.py` covers ours. Every optimizer of ``torch.optim`` is tried
where Horovod tries them all, except L-BFGS (its step needs a closure) and
SparseAdam (sparse gradients only), which Horovod leaves out too.
"""

import inspect
import warnings

import horovod.torch as hvd
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same_on_every_rank
from torch import nn

import horovod_powersgd as hps

# Every torch optimizer that steps on dense gradients without a closure.
OPTIMIZERS = sorted(
    (
        c
        for c in torch.optim.Optimizer.__subclasses__()
        if c.__module__.startswith("torch.optim")
        and c not in (torch.optim.LBFGS, torch.optim.SparseAdam)
    ),
    key=lambda c: c.__name__,
)


def build(cls, params, **options):
    """`cls(params, **options)`, with the options that `cls` takes."""
    accepted = inspect.signature(cls).parameters
    return cls(params, **{k: v for k, v in options.items() if k in accepted})


class TwoHeads(nn.Module):
    """A trunk and two heads; 2-D weights only (Muon takes nothing else)."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = nn.Linear(24, 16, bias=False)
        self.head = nn.Linear(16, 6, bias=False)
        self.other_head = nn.Linear(16, 6, bias=False)

    def forward(self, x):
        h = F.relu(self.trunk(x))
        return self.head(h), self.other_head(h)


def data(step, rank=None):
    g = torch.Generator().manual_seed(100 * step + (hvd.rank() if rank is None else rank))
    return torch.randn(8, 24, generator=g), torch.randn(8, 6, generator=g)


def wrap(opt, model, **kwargs):
    return hps.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **kwargs)


def one_step(model, opt, step=0, head="head"):
    x, y = data(step)
    opt.zero_grad()
    out = dict(zip(("head", "other_head"), model(x)))
    F.mse_loss(out[head], y).backward()
    opt.step()


def state_values(opt):
    """The wrapped optimizer's per-parameter state, in order: (index, key, value)."""
    state = opt.state_dict()["state"]
    return [(i, k, v) for i in sorted(state) for k, v in sorted(state[i].items())]


def assert_same_value(mine, theirs, where):
    assert type(mine) is type(theirs), where
    if torch.is_tensor(mine):
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), where
    else:
        assert mine == theirs, where


@pytest.mark.parametrize("options", [{"lr": 0.02}, {"lr": 0.02, "momentum": 0.9}])
@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_a_rank0_load_then_the_broadcasts_give_every_rank_rank0s_state(cls, options):
    """Horovod's ``test_broadcast_state``.

    Rank 0 alone loads a saved model and optimizer state into freshly built ones;
    hvd.broadcast_parameters and hvd.broadcast_optimizer_state then give every rank
    rank 0's parameters and the wrapped optimizer's state, values and types.
    """
    model = TwoHeads()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = wrap(build(cls, model.parameters(), **options), model)
    one_step(model, opt)
    saved = hvd.broadcast_object(
        {"model": model.state_dict(), "optimizer": opt.state_dict()}, root_rank=0
    )
    fresh = TwoHeads(seed=10 + hvd.rank())  # every rank starts elsewhere
    fresh_opt = wrap(build(cls, fresh.parameters(), **options), fresh)
    if hvd.rank() == 0:
        fresh.load_state_dict(saved["model"])
        fresh_opt.load_state_dict(saved["optimizer"])
    hvd.broadcast_parameters(fresh.state_dict(), root_rank=0)
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, saved["model"][name]), name
    # (Its first step on the ranks without state moves their parameters where the
    # optimizer decays weights, as with Horovod's optimizer: the drift check repairs that.)
    hvd.broadcast_optimizer_state(fresh_opt, root_rank=0)
    expected = saved["optimizer"]["state"]
    got = state_values(fresh_opt)
    assert len(got) == sum(len(s) for s in expected.values())
    for index, key, value in got:
        assert_same_value(value, expected[index][key], f"{cls.__name__} {index}.{key}")


# Each rank builds its optimizer with its own options; rank 0's are these.
RANK0_OPTIONS = dict(
    lr=0.03, momentum=0.7, weight_decay=0.05, nesterov=True, betas=(0.85, 0.99),
    etas=(0.6, 1.3), step_sizes=(1e-6, 10.0), alpha=0.9, rho=0.8,
)  # fmt: skip
OTHER_OPTIONS = dict(
    lr=0.2, momentum=0.95, weight_decay=0.0, nesterov=False, betas=(0.7, 0.9),
    etas=(0.4, 1.1), step_sizes=(1e-4, 2.0), alpha=0.5, rho=0.6,
)  # fmt: skip


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_options_built_differently_per_rank_are_rank0s_after_broadcast_optimizer_state(cls):
    """Horovod's ``test_broadcast_state_options``.

    Each rank builds the wrapped optimizer with its own learning rate, momentum,
    betas, ... and steps once; after hvd.broadcast_optimizer_state every rank holds
    rank 0's options (same values, same types, tuples included), and the next step
    works with them. Horovod's first step uses each rank's own options; ours warns
    on every rank, naming them, and uses rank 0's already, so the parameters are
    the same on every rank throughout.
    """
    model = TwoHeads()
    options = RANK0_OPTIONS if hvd.rank() == 0 else OTHER_OPTIONS
    opt = wrap(build(cls, model.parameters(), **options), model)
    with pytest.warns(UserWarning, match="settings differed across ranks at step 0: .*'lr'"):
        one_step(model, opt, 0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    accepted = inspect.signature(cls).parameters
    for key, value in RANK0_OPTIONS.items():
        if key in accepted:
            assert_same_value(opt.param_groups[0][key], value, f"{cls.__name__}.{key}")
    one_step(model, opt, 1)
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        assert_same_on_every_rank(p, f"options.{cls.__name__}.{name}")


class IndexedScale(nn.Module):
    """A frozen integer parameter (which rows) and a trained one (their scales)."""

    def __init__(self):
        super().__init__()
        self.rows = nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
        self.scale = nn.Parameter(torch.rand(4))

    def forward(self, x):
        return self.scale.index_select(0, self.rows.long()) * x


def test_a_frozen_integer_parameter_survives_the_broadcasts():
    """Horovod's ``test_broadcast_state_no_grad``.

    A parameter that takes no gradient (an integer one) is left alone by the
    broadcasts and by training: it never gets a gradient, while the trained
    parameter's gradient and value are the same on every rank.
    """
    torch.manual_seed(hvd.rank())
    model = IndexedScale()
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True), model)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert model.rows.grad is None
    assert_same_on_every_rank(model.scale.grad, "no_grad.scale.grad")
    for step in range(2):
        opt.zero_grad()
        model(data(step)[0][:, :2]).sum().backward()
        opt.step()
    assert model.rows.grad is None and model.rows.tolist() == [1, 3]
    assert_same_on_every_rank(model.scale, "no_grad.scale")


@pytest.mark.parametrize("options", [{"lr": 0.02}, {"lr": 0.02, "momentum": 0.9}])
@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_a_parameter_unused_on_one_rank_still_gets_the_average(cls, options):
    """Horovod's ``test_force_allreduce``.

    Rank 0's loss reads one head, every other rank's the other: each head gets
    no gradient on some rank. The step still completes on every rank (no hang),
    every gradient is the average over the ranks (zero where unused), and the
    parameters stay equal on every rank.
    """
    model = TwoHeads()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = wrap(build(cls, model.parameters(), **options), model, rank=16)  # full rank: exact
    head = "head" if hvd.rank() == 0 else "other_head"
    x, y = data(0)
    out = dict(zip(("head", "other_head"), model(x)))
    loss = F.mse_loss(out[head], y)
    local = torch.zeros_like(model.head.weight)  # unused here: zero
    if head == "head":
        (local,) = torch.autograd.grad(loss, model.head.weight, retain_graph=True)
    average = hvd.allreduce(local, name=f"force.{cls.__name__}.{len(options)}")
    opt.zero_grad()
    loss.backward()
    opt.synchronize()
    torch.testing.assert_close(model.head.weight.grad, average, rtol=1e-5, atol=1e-7)
    with opt.skip_synchronize():
        opt.step()
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        assert_same_on_every_rank(p, f"force.{cls.__name__}.{name}")


def test_duplicate_names_are_refused():
    """Horovod's ``test_duplicate_names``: two modules' parameters under the same names."""
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    opt = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1)
    with pytest.raises(ValueError, match="unique"):
        hps.DistributedOptimizer(
            opt, named_parameters=[*first.named_parameters(), *second.named_parameters()]
        )


def test_unnamed_parameters_are_refused():
    """Horovod's ``test_missing_named_parameters``: names for only part of the parameters."""
    model = TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="missing from named_parameters"):
        hps.DistributedOptimizer(opt, named_parameters=list(model.named_parameters())[:1])


def test_named_parameters_may_be_left_out():
    """Horovod's ``test_no_named_parameters``: without names it trains all the same."""
    model = TwoHeads()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    for step in range(2):
        one_step(model, opt, step)
    assert opt.compression_stats()["steps"] == 2
    for name, p in model.named_parameters():
        assert_same_on_every_rank(p, f"unnamed.{name}")


def test_parameter_names_name_every_parameter_alike_on_every_rank():
    """Horovod's ``test_optimizer_no_named_parameters``.

    `opt._parameter_names`, Horovod's mapping from each parameter to its name
    (which user code reads to log per-layer values), exists here too: without
    named_parameters it names every parameter of every param group, each name
    once and the same names on every rank; with them, it maps to those names.
    """
    model = TwoHeads()
    groups = [{"params": model.trunk.parameters()}, {"params": model.head.parameters()}]
    opt = hps.DistributedOptimizer(torch.optim.SGD(groups, lr=0.01))
    names = opt._parameter_names
    assert set(names) == {model.trunk.weight, model.head.weight}
    assert len(set(names.values())) == len(names)
    everyone = hvd.allgather_object(sorted(names.values()), name="suite.parameter_names")
    assert all(theirs == everyone[0] for theirs in everyone)
    named = wrap(torch.optim.SGD(model.parameters(), lr=0.01), model)
    assert named._parameter_names == {p: n for n, p in model.named_parameters()}


class Gate(nn.Module):
    def __init__(self, inputs, outputs):
        super().__init__()
        self.linear = nn.Linear(inputs, outputs)

    def forward(self, x):
        return torch.tanh(self.linear(x))


def test_requires_grad_switched_between_two_optimizers():
    """Horovod's ``test_dynamic_requires_grad``.

    A generator and a discriminator, each with its own optimizer, trained in turn
    by switching requires_grad: only the part being trained gets gradients, and
    both stay equal on every rank.
    """
    torch.manual_seed(0)
    gen, disc = Gate(6, 12), Gate(12, 1)
    for part in (gen, disc):
        hvd.broadcast_parameters(part.state_dict(), root_rank=0)
    gen_opt = wrap(torch.optim.SGD(gen.parameters(), lr=0.05), gen)
    disc_opt = wrap(torch.optim.SGD(disc.parameters(), lr=0.05), disc)
    x = data(0)[0][:, :6]
    for _ in range(5):
        for trained, opt in ((gen, gen_opt), (disc, disc_opt)):
            for part in (gen, disc):
                part.requires_grad_(part is trained)
            gen_opt.zero_grad()
            disc_opt.zero_grad()
            disc(gen(x)).sum().backward()
            for part in (gen, disc):
                for p in part.parameters():
                    has_gradient = p.grad is not None and bool(p.grad.abs().max() > 0)
                    assert has_gradient == (part is trained)
            opt.step()
    for part in (gen, disc):
        for name, p in part.named_parameters():
            assert_same_on_every_rank(p, f"dynamic.{name}")


def test_gradients_clipped_between_synchronize_and_step_are_applied():
    """Horovod's ``test_gradient_clipping``.

    synchronize() leaves the aggregated gradient in p.grad; clipping it shrinks
    it, and the step inside skip_synchronize() applies the clipped gradient.
    """
    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    with torch.no_grad():
        model.weight.fill_(0.5)
        model.bias.zero_()
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1), model)
    F.mse_loss(model(torch.ones(1, 1)), torch.ones(1, 1)).backward()
    opt.synchronize()
    before = model.weight.grad.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    clipped = model.weight.grad.item()
    assert abs(clipped) < abs(before)
    with opt.skip_synchronize():
        opt.step()
    assert model.weight.item() == pytest.approx(0.5 - 0.1 * clipped)


def test_step_after_synchronize_without_skip_warns_once():
    """Horovod's ``test_synchronize_step_warning``: Horovod's words, one warning."""
    model = nn.Linear(1, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1), model)
    F.mse_loss(model(torch.zeros(1, 1)), torch.ones(1, 1)).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert "optimizer.step() called without optimizer.skip_synchronize()" in str(caught[0].message)


def embedding_inputs(step):
    # Each rank looks up its own rows, some shared with the other ranks.
    g = torch.Generator().manual_seed(10 * step + hvd.rank())
    return torch.randint(0, 10, (2, 4), generator=g)


def test_sparse_as_dense_trains_sparse_adam_as_horovod_does():
    """Horovod's ``test_sparse_embeddings`` (sparse_as_dense=True).

    A sparse embedding trained with torch.optim.SparseAdam, which takes sparse
    gradients only: the aggregate is handed back sparse before the step, and a
    matrix too small to compress trains exactly as with Horovod's optimizer.
    """
    results = {}
    for kind in ("horovod", "powersgd"):
        torch.manual_seed(0)
        emb = nn.Embedding(10, 3, sparse=True)
        adam = torch.optim.SparseAdam(list(emb.parameters()), lr=0.1)
        wrapper = hvd.DistributedOptimizer if kind == "horovod" else hps.DistributedOptimizer
        opt = wrapper(adam, named_parameters=emb.named_parameters(), sparse_as_dense=True)
        for step in range(3):
            opt.zero_grad()
            emb(embedding_inputs(step)).sum().backward()
            opt.step()
            assert emb.weight.grad.is_sparse, kind
        results[kind] = emb.weight.detach().clone()
    assert torch.equal(results["powersgd"], results["horovod"])
    assert_same_on_every_rank(results["powersgd"], "sparse.small")


def test_sparse_as_dense_with_compressed_embeddings_trains_sparse_adam():
    """Horovod's ``test_sparse_embeddings``, with an embedding large enough to compress."""
    torch.manual_seed(0)
    emb = nn.Embedding(200, 32, sparse=True)
    opt = hps.DistributedOptimizer(
        torch.optim.SparseAdam(list(emb.parameters()), lr=0.01),
        named_parameters=emb.named_parameters(),
        sparse_as_dense=True,
    )
    assert opt.compressor.is_compressed("weight")
    before = emb.weight.detach().clone()
    for step in range(3):
        opt.zero_grad()
        emb(embedding_inputs(step) * 20).pow(2).sum().backward()
        opt.step()
        assert emb.weight.grad.is_sparse
    assert opt.compression_stats()["ratio"] > 10
    assert not torch.equal(emb.weight, before)
    assert torch.isfinite(emb.weight).all()
    assert_same_on_every_rank(emb.weight, "sparse.compressed")


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_embeddings(sparse_as_dense):
    """Horovod's ``test_sparse_embeddings``, both halves, with the one-line swap.

    Horovod's own inputs (rank 0 looks up 8 rows, the others 6), SparseAdam and
    no named_parameters, as there: the step runs on every rank. Without
    sparse_as_dense the gradient is all-gathered (indices and values) as
    Horovod does, outside PowerSGD; the result matches Horovod's optimizer and
    is the same on every rank.
    """
    results = {}
    for kind in ("horovod", "powersgd"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(10, 3, sparse=True))
        if hvd.rank() == 0:
            inp = torch.LongTensor([[1, 2, 4, 5], [4, 3, 2, 9]])
        else:
            inp = torch.LongTensor([[1, 3, 4], [4, 7, 9]])
        opt = torch.optim.SparseAdam(list(model.parameters()), lr=0.1)
        wrapper = hvd.DistributedOptimizer if kind == "horovod" else hps.DistributedOptimizer
        opt = wrapper(opt, sparse_as_dense=sparse_as_dense)
        for _ in range(3):  # Horovod's test steps once; later steps all-gather from the start
            loss = model(inp).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            assert model[0].weight.grad.is_sparse, kind
        results[kind] = model[0].weight.detach().clone()
    torch.testing.assert_close(results["powersgd"], results["horovod"], rtol=1e-6, atol=1e-7)
    assert_same_on_every_rank(results["powersgd"], f"sparse.horovod.{sparse_as_dense}")
