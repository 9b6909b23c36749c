"""Sparse gradients (nn.Embedding(sparse=True)) as Horovod users train them (issue 52).

Every rank runs every test (see conftest.py); a hang fails by pytest-timeout.
"""

import copy

import horovod.torch as hvd
import pytest
import torch
from helpers import assert_same_on_every_rank
from torch import nn

import horovod_powersgd as hps


class EmbeddingModel(nn.Module):
    """A sparse embedding beside dense layers, as in a recommender or language model."""

    def __init__(self, rows=512, width=32, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embedding = nn.Embedding(rows, width, sparse=True)
        self.hidden = nn.Linear(width, 64)
        self.out = nn.Linear(64, 4)

    def forward(self, ids):
        return self.out(torch.relu(self.hidden(self.embedding(ids).mean(1))))


def lookups(step, rows, skip_rank=None):
    """This rank's ids at `step`; None where `skip_rank` does no lookup (its even steps)."""
    if hvd.rank() == skip_rank and step % 2 == 0:
        return None
    g = torch.Generator().manual_seed(100 * step + hvd.rank())
    return torch.randint(0, rows, (8, 5), generator=g)


def loss_of(model, ids):
    if ids is None:  # a data-dependent path that does not touch the embedding
        return model.out(torch.relu(model.hidden(torch.ones(8, model.hidden.in_features))))
    return model(ids)


def run(model, opt, steps, skip_rank=None, set_to_none=True):
    for step in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        ids = lookups(step, model.embedding.num_embeddings, skip_rank)
        loss_of(model, ids).pow(2).mean().backward()
        opt.step()


def wrap(model, optimizer, **kwargs):
    return hps.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), sparse_as_dense=True, **kwargs
    )


def assert_model_same_on_every_rank(model, tag):
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        assert_same_on_every_rank(p, f"{tag}.{name}")


# --- item 1: rank="auto" measures on the dense aggregate --------------------------------
@pytest.mark.parametrize("link", [None, "10mbit"])
def test_auto_with_sparse_as_dense_measures_and_trains(link):
    model = EmbeddingModel(rows=4096, width=256)
    opt = wrap(model, torch.optim.SGD(model.parameters(), lr=0.05), rank="auto", auto_link=link)
    run(model, opt, steps=12)  # 8 measuring steps (the probes at 6 and 7), then a plan
    assert opt.powersgd_state.tuner.phase != "measure"
    assert model.embedding.weight.grad.is_sparse
    assert_model_same_on_every_rank(model, f"auto.{link}")


# --- item 2: gradients kept between steps, momentum --------------------------------------
def test_sparse_as_dense_with_zero_grad_keeping_tensors_and_momentum():
    model = EmbeddingModel()
    opt = wrap(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    opt.powersgd_state.guard.every = 2  # check (and fingerprint the sparse momentum) often
    run(model, opt, steps=5, set_to_none=False)
    assert opt.powersgd_state.guard.checks >= 2
    assert opt.state[model.embedding.weight]["momentum_buffer"].is_sparse
    assert_model_same_on_every_rank(model, "keep")


def test_a_drifted_sparse_momentum_buffer_is_repaired():
    model = EmbeddingModel()
    opt = wrap(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    run(model, opt, steps=2)
    weight = model.embedding.weight
    buffer = opt.state[weight]["momentum_buffer"]
    if hvd.rank() == 1:  # this rank's buffer and weight drift apart from the others'
        opt.state[weight]["momentum_buffer"] = (buffer.to_dense() * 1.5).to_sparse()
        with torch.no_grad():
            weight.add_(1e-3)
    assert opt.powersgd_state.guard.check(opt.state) == ["embedding.weight"]
    assert opt.state[weight]["momentum_buffer"].is_sparse
    assert_same_on_every_rank(opt.state[weight]["momentum_buffer"].to_dense(), "repaired.buf")
    assert_same_on_every_rank(weight, "repaired.weight")


# --- item 3: an embedding one rank does not use ----------------------------------------
def test_sparse_adam_when_one_rank_skips_the_embedding():
    model = EmbeddingModel()
    dense = [p for n, p in model.named_parameters() if not n.startswith("embedding")]
    sparse_adam = wrap(
        model.embedding, torch.optim.SparseAdam(list(model.embedding.parameters()), lr=0.01)
    )
    adam = hps.DistributedOptimizer(
        torch.optim.Adam(dense, lr=0.01),
        named_parameters=[(n, p) for n, p in model.named_parameters() if p in set(dense)],
        sparse_as_dense=True,
    )
    for step in range(6):
        sparse_adam.zero_grad()
        adam.zero_grad()
        loss_of(model, lookups(step, 512, skip_rank=1)).pow(2).mean().backward()
        # Every rank, also the one without a lookup, gets a sparse gradient.
        sparse_adam.step()
        adam.step()
        assert model.embedding.weight.grad.is_sparse, step
    assert_model_same_on_every_rank(model, "sparse_adam")


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_when_one_rank_skips_the_embedding_stays_bitwise_identical(momentum):
    model = EmbeddingModel()
    opt = wrap(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum))
    run(model, opt, steps=12, skip_rank=1)
    assert model.embedding.weight.grad.is_sparse
    assert_model_same_on_every_rank(model, f"skip.{momentum}")


def test_a_dense_model_agrees_on_sparsity_once():
    model = nn.Linear(8, 4)
    opt = hps.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    for _ in range(3):
        opt.zero_grad()
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
        assert not opt.powersgd_state.sparse.checks  # from the first step on: no more checks
    assert not opt.powersgd_state.sparse.sparse


# --- item 7: without sparse_as_dense, sparse gradients are all-gathered ---------------------
def gathering(model, optimizer, **kwargs):
    return hps.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), **kwargs)


def test_without_sparse_as_dense_the_embedding_leaves_powersgd_and_is_all_gathered():
    model = EmbeddingModel(rows=512, width=32)
    opt = gathering(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    assert opt.compressor.is_compressed("embedding.weight")  # large enough, until seen sparse
    run(model, opt, steps=1)  # the first sparse gradient travels dense in its bucket
    assert not opt.compressor.is_compressed("embedding.weight")
    assert opt.compressor.is_compressed("hidden.weight")  # its neighbours stay compressed
    sent = opt.compression_stats()["elements_sent"]
    run(model, opt, steps=4)
    assert model.embedding.weight.grad.is_sparse
    stats = opt.compression_stats()
    # Each step all-gathers this rank's coalesced rows (at most 40 ids: 32 values and an
    # index each) beside P, Q and the small tensors that travel as they are.
    compressed = opt.compressor.compressed_names
    plain = sum(p.numel() for n, p in model.named_parameters() if n not in compressed)
    plain -= model.embedding.weight.numel()
    per_step = 40 * 33 + sum(opt.compressor.elements_per_step()) + plain
    assert 4 * plain < stats["elements_sent"] - sent <= 4 * per_step
    numel = sum(p.numel() for p in model.parameters())
    assert stats["elements_uncompressed"] == 5 * numel  # counted as a plain all-reduce would
    assert_model_same_on_every_rank(model, "gathered")


def test_all_gathered_gradient_is_the_average_of_the_ranks_gradients():
    emb = nn.Embedding(10, 3, sparse=True)
    opt = gathering(emb, torch.optim.SGD(emb.parameters(), lr=0.0))
    for step in range(3):
        opt.zero_grad()
        ids = torch.tensor([[hvd.rank(), 5, step + 1]])
        weights = torch.full((1, 3, 3), float(hvd.rank() + 1))
        (emb(ids) * weights).sum().backward()
        opt.step()
    expected = torch.zeros(10, 3)
    for r in range(hvd.size()):
        for row in (r, 5, 3):
            expected[row] += (r + 1) / hvd.size()
    assert emb.weight.grad.is_sparse
    torch.testing.assert_close(emb.weight.grad.to_dense(), expected)


def test_under_fp16_compression_all_gathered_sparse_values_keep_their_dtype():
    # As Horovod sends them (and as the README says): Compression.fp16 halves what is
    # all-reduced, not a sparse gradient's all-gathered values.
    emb = nn.Embedding(10, 3, sparse=True)
    opt = gathering(emb, torch.optim.SGD(emb.parameters(), lr=0.0),
                    compression=hvd.Compression.fp16)  # fmt: skip
    third = 1.0 / 3.0  # not a float16 number
    for _ in range(2):
        opt.zero_grad()
        (emb(torch.tensor([[hvd.rank()]])) * third * (hvd.rank() + 1)).sum().backward()
        opt.step()
    expected = torch.zeros(10, 3)
    for r in range(hvd.size()):
        expected[r] = torch.tensor(third, dtype=torch.float32) * (r + 1) / hvd.size()
    assert emb.weight.grad.is_sparse and emb.weight.grad.dtype == torch.float32
    assert torch.equal(emb.weight.grad.to_dense(), expected)


@pytest.mark.parametrize("kind", ["sgd", "sparse_adam"])
def test_without_sparse_as_dense_a_rank_that_skips_the_embedding(kind):
    model = EmbeddingModel()
    if kind == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        opt = gathering(model, optimizer)
        run(model, opt, steps=8, skip_rank=1)
    else:
        opt = gathering(
            model.embedding, torch.optim.SparseAdam(list(model.embedding.parameters()), lr=0.01)
        )
        for step in range(6):
            opt.zero_grad()
            model.embedding.zero_grad()
            ids = lookups(step, 512, skip_rank=1)
            if ids is not None:
                model.embedding(ids).pow(2).sum().backward()
            opt.step()  # a rank without a lookup joins the all-gather with no rows
            assert model.embedding.weight.grad is None or model.embedding.weight.grad.is_sparse
    assert_model_same_on_every_rank(model, f"gathered.skip.{kind}")


def test_a_resume_keeps_the_embedding_all_gathered():
    model = EmbeddingModel()
    opt = gathering(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    run(model, opt, steps=2)
    state = copy.deepcopy(opt.state_dict())  # as saved: the live buffers move on
    resumed = EmbeddingModel()
    resumed.load_state_dict(model.state_dict())
    resumed_opt = gathering(resumed, torch.optim.SGD(resumed.parameters(), lr=0.05, momentum=0.9))
    resumed_opt.load_state_dict(state)
    assert not resumed_opt.compressor.is_compressed("embedding.weight")
    run(resumed, resumed_opt, steps=2)
    run(model, opt, steps=2)
    for (name, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
