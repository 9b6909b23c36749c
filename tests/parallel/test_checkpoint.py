"""save_checkpoint / load_checkpoint: every rank resumes exactly, or is told why not.

Every rank runs every test on one checkpoint directory, rank 0's, so files
written by one rank are seen by the others as on a shared file system.
"""

import glob
import os

import horovod.torch as hvd
import numpy as np
import pytest
import torch
from helpers import assert_same_on_every_rank, make_model, powersgd, train

import horovod_powersgd as hps


@pytest.fixture
def path(shared_dir):
    return os.path.join(shared_dir, "ckpt.pt")


def rank_file(path, rank):
    """The one file of `rank` beside `path` (whatever the naming scheme)."""
    [name] = glob.glob(f"{glob.escape(path)}.powersgd-*rank{rank}-of-{hvd.size()}")
    return name


def read_bytes(name):
    with open(name, "rb") as f:
        return f.read()


def write_bytes(name, data):
    with open(name, "wb") as f:
        f.write(data)


def snapshot(model, opt):
    state = opt.compressor.state_dict()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "error_buffers": {k: v.clone() for k, v in state["error_buffers"].items()},
        "q_memory": {k: v.clone() for k, v in state["q_memory"].items()},
        "step": opt.powersgd_step,
    }


def assert_state(model, opt, expected, error_buffers="as saved"):
    now = snapshot(model, opt)
    assert now["step"] == expected["step"]
    assert all(torch.equal(a, b) for a, b in zip(now["params"], expected["params"]))
    for name, q in expected["q_memory"].items():
        assert torch.equal(now["q_memory"][name], q), name
    for name, error in expected["error_buffers"].items():
        wanted = torch.zeros_like(error) if error_buffers == "zero" else error
        assert torch.equal(now["error_buffers"][name], wanted), name


def test_resume_is_bit_exact(path):
    model = make_model()
    opt = powersgd(model, rank=2, warm_start=False)
    train(model, opt, steps=4)
    hps.save_checkpoint(path, model, opt, epoch=3)
    train(model, opt, steps=4, first_step=4)

    resumed = make_model(seed=123)
    resumed_opt = powersgd(resumed, rank=2, warm_start=False)
    extra = hps.load_checkpoint(path, resumed, resumed_opt)
    assert extra == {"epoch": 3}
    train(resumed, resumed_opt, steps=4, first_step=4)
    for (n, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), n
    assert resumed_opt.compression_stats() == opt.compression_stats()


class SparseEmbeddingModel(torch.nn.Module):
    """A sparse embedding (large enough to be compressed until seen sparse) before a head."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(256, 32, sparse=True)
        self.head = torch.nn.Linear(32, 8)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))


def train_sparse(model, opt, steps, first_step=0):
    for step in range(first_step, first_step + steps):
        g = torch.Generator().manual_seed(100 * step + hvd.rank())
        ids = torch.randint(0, 256, (8, 5), generator=g)
        opt.zero_grad()
        model(ids).pow(2).mean().backward()
        opt.step()


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_resume_of_a_model_with_a_sparse_embedding_is_bit_exact(path, sparse_as_dense):
    # The embedding leaves PowerSGD (sparse_as_dense=False) at its first sparse gradient;
    # a fresh optimizer still counts it as compressed until the checkpoint says otherwise.
    def build(seed):
        model = SparseEmbeddingModel(seed)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return model, hps.DistributedOptimizer(
            opt, named_parameters=model.named_parameters(), rank=2,
            sparse_as_dense=sparse_as_dense,
        )  # fmt: skip

    model, opt = build(0)
    train_sparse(model, opt, steps=6)
    assert opt.compressor.is_compressed("emb.weight") == sparse_as_dense
    hps.save_checkpoint(path, model, opt)
    train_sparse(model, opt, steps=4, first_step=6)

    resumed, resumed_opt = build(123)
    assert resumed_opt.compressor.is_compressed("emb.weight")
    hps.load_checkpoint(path, resumed, resumed_opt)
    assert resumed_opt.compressor.is_compressed("emb.weight") == sparse_as_dense
    train_sparse(resumed, resumed_opt, steps=4, first_step=6)
    assert resumed.emb.weight.grad.is_sparse
    for (n, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), n
        assert_same_on_every_rank(b, f"sparse_resume.{n}")
    assert resumed_opt.compression_stats() == opt.compression_stats()


@pytest.mark.parametrize("rounds", [2, 1])
def test_horovods_rank0_resume_from_the_main_file_keeps_the_shared_state(path, rank, rounds):
    # Issue 23, item 6: saved with save_checkpoint, loaded the way Horovod's examples
    # load theirs: rank 0 reads the main file's optimizer state, then broadcasts.
    model = make_model()
    opt = powersgd(model, rank=2, rounds=rounds, start_iter=4)
    train(model, opt, steps=7)  # rounds=1: the next step is a P-step
    hps.save_checkpoint(path, model, opt)
    shared = opt.compressor.shared_state()

    resumed = make_model(seed=123)
    resumed_opt = powersgd(resumed, rank=2, rounds=rounds, start_iter=4)
    if rank == 0:
        main = torch.load(path, weights_only=True)
        resumed.load_state_dict(main["model"])
        with pytest.warns(UserWarning, match="error buffers, which start at zero"):
            resumed_opt.load_state_dict(main["optimizer"])
        # The main file held the step counter (the only one: the compressor's
        # alternation follows it), the memories and the RNG states.
        assert resumed_opt.powersgd_step == 7
        loaded = resumed_opt.compressor.shared_state()
        for kind in ("q_memory", "p_memory") if rounds == 1 else ("q_memory",):
            for name, tensor in shared[kind].items():
                assert torch.equal(loaded[kind][name], tensor), (kind, name)
        assert all(torch.equal(a, b) for a, b in zip(loaded["rng_states"], shared["rng_states"]))
    hvd.broadcast_parameters(resumed.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(resumed_opt, root_rank=0)
    before = resumed_opt.compression_stats()
    with pytest.warns(UserWarning, match="took the PowerSGD state of rank 0"):
        train(resumed, resumed_opt, steps=1, first_step=7)
    # Every rank went on from step 7, compressed (no second warm-up), in step.
    assert resumed_opt.powersgd_step == 8
    after = resumed_opt.compression_stats()
    sent = after["elements_sent"] - before["elements_sent"]
    assert sent < after["elements_uncompressed"] - before["elements_uncompressed"]
    for kind, tensors in resumed_opt.compressor.shared_state().items():
        if isinstance(tensors, dict):
            for name, tensor in tensors.items():
                assert_same_on_every_rank(tensor, f"{kind}.{name}")
    for n, p in resumed.named_parameters():
        assert torch.isfinite(p).all(), n
        assert_same_on_every_rank(p, n)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("damage", ["is missing", "is of another checkpoint"])
def test_rank_file_missing_or_of_an_earlier_save_warns_and_resets_only_that_rank(
    path, rank, damage
):
    model = make_model()
    opt = powersgd(model, rank=2)
    train(model, opt, steps=4)
    hps.save_checkpoint(path, model, opt)
    earlier = read_bytes(rank_file(path, 1))
    train(model, opt, steps=4, first_step=4)
    hps.save_checkpoint(path, model, opt)
    saved = snapshot(model, opt)
    if rank == 1:
        if damage == "is missing":
            os.remove(rank_file(path, 1))
        else:  # as a node restored from an old backup would have it
            write_bytes(rank_file(path, 1), earlier)
    hvd.barrier()

    resumed = make_model(seed=123)
    resumed_opt = powersgd(resumed, rank=2)
    # Every rank warns alike (so -W error raises everywhere, never on one rank alone).
    with pytest.warns(UserWarning, match=rf"rank 1: .*rank1-of-2 {damage}.*error buffers"):
        hps.load_checkpoint(path, resumed, resumed_opt)
    if rank == 1:
        # The checkpoint's step counter (8, never the earlier 4) and Q memory,
        # equal on every rank, so the ranks keep training in step; residuals zero.
        assert_state(resumed, resumed_opt, saved, error_buffers="zero")
    else:
        assert_state(resumed, resumed_opt, saved)


@pytest.mark.world_size(2)
def test_no_rank_file_of_the_checkpoint_raises_on_every_rank_and_changes_nothing(path, rank):
    model = make_model()
    opt = powersgd(model, rank=2)
    train(model, opt, steps=4)
    hps.save_checkpoint(path, model, opt)
    earlier = read_bytes(rank_file(path, rank))
    train(model, opt, steps=2, first_step=4)
    hps.save_checkpoint(path, model, opt)
    write_bytes(rank_file(path, rank), earlier)  # every rank file is of the earlier save
    hvd.barrier()

    train(model, opt, steps=1, first_step=6)
    before = snapshot(model, opt)
    with pytest.raises(FileNotFoundError, match=r"rank\(s\) \[0, 1\].*rank0-of-2.*rank1-of-2"):
        hps.load_checkpoint(path, model, opt)
    assert_state(model, opt, before)


class RunsCodeWhenLoaded:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.mark.world_size(2)
def test_rank_file_that_would_run_code_is_refused_on_every_rank(path, rank):
    model = make_model()
    opt = powersgd(model, rank=2)
    train(model, opt, steps=2)
    hps.save_checkpoint(path, model, opt)
    marker = os.path.join(os.path.dirname(path), "code-ran")
    if rank == 1:
        name = rank_file(path, 1)
        crafted = torch.load(name, weights_only=True)
        crafted["powersgd"] = RunsCodeWhenLoaded(marker)
        torch.save(crafted, name)
    hvd.barrier()

    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\]: .*rank1-of-2.*weights_only"):
        hps.load_checkpoint(path, model, opt)
    assert not os.path.exists(marker)
    assert_state(model, opt, before)  # rank 0 could read its files, and changed nothing either


@pytest.mark.world_size(2)
@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (np.float64(0.5), r"extra\['best'\] is a numpy.float64"),
        ({"schedule": lambda step: 0.1}, r"extra\['best'\]\['schedule'\] is a builtins.function"),
    ],
    ids=["numpy scalar", "function in a dict"],
)
def test_extra_that_would_not_load_safely_is_refused_on_every_rank_before_writing(
    path, rank, bad, message
):
    model = make_model()
    opt = powersgd(model, rank=2)
    train(model, opt, steps=1)
    with pytest.raises(ValueError, match=rf"rank\(s\) \[1\]: {message}"):
        hps.save_checkpoint(path, model, opt, epoch=1, best=bad if rank == 1 else 0.5)
    hvd.barrier()
    assert os.listdir(os.path.dirname(path)) == []

    # What the docstring allows comes back as saved.
    extra = {
        "epoch": 1,
        "best": 0.5,
        "tags": ["a", None, True, 2 + 1j, b"x"],
        "scheduler": {"last_epoch": 3, "lrs": (0.1, 0.01), "kinds": {"step"}},
        "layout": (torch.Size([2, 3]), torch.float16, torch.device("cpu")),
        "ema": torch.arange(3.0),
    }
    hps.save_checkpoint(path, model, opt, **extra)
    loaded = hps.load_checkpoint(path, model, opt)
    assert torch.equal(loaded.pop("ema"), extra.pop("ema"))
    assert loaded == extra


def test_save_that_fails_before_the_main_file_keeps_the_previous_checkpoint(
    path, rank, monkeypatch
):
    model = make_model()
    opt = powersgd(model, rank=2)
    train(model, opt, steps=4)
    hps.save_checkpoint(path, model, opt, epoch=1)
    saved = snapshot(model, opt)
    train(model, opt, steps=2, first_step=4)

    save = torch.save

    def main_file_fails(obj, name, *args, **kwargs):
        if str(name).startswith(f"{path}.tmp"):
            raise OSError("No space left on device")
        return save(obj, name, *args, **kwargs)

    monkeypatch.setattr(torch, "save", main_file_fails)
    with pytest.raises(OSError, match=r"rank\(s\) \[0\]: cannot write .*No space left"):
        hps.save_checkpoint(path, model, opt, epoch=2)
    monkeypatch.undo()

    resumed = make_model(seed=123)
    resumed_opt = powersgd(resumed, rank=2)
    assert hps.load_checkpoint(path, resumed, resumed_opt) == {"epoch": 1}
    assert_state(resumed, resumed_opt, saved)
    # The next save that succeeds removes the files of the earlier and the failed one.
    hps.save_checkpoint(path, resumed, resumed_opt, epoch=2)
    assert len(glob.glob(f"{glob.escape(path)}.powersgd-*")) == hvd.size()
