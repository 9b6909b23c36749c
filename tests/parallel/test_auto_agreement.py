"""rank="auto" where the ranks see different things: one decision for every rank, no hang.

Each test gives the ranks different views (a parameter unused on one rank, link
timings or statistics that differ per rank, an environment variable set on one
rank) and checks that every rank still takes the same plan and stays bitwise
identical. Before each fix these hung or crashed; the per-test timeout turns a
hang into a failure (pytest-timeout ends the processes; the run fails).
"""

import horovod.torch as hvd
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same_on_every_rank, batch, local_gradients
from torch import nn

import horovod_powersgd as hps
from horovod_powersgd import reducer as reducer_module
from horovod_powersgd import tuner as tuner_module

SETTLED = tuner_module.MEASURE_STEPS + 4 * tuner_module.TRIAL_STEPS  # at the latest


@pytest.fixture(autouse=True)
def small_buckets(monkeypatch):
    """Buckets of 64 KB: several of them in a small model, each planned apart."""
    monkeypatch.setattr(reducer_module, "BUCKET_BYTES", 64 * 1024)


class Branchy(nn.Module):
    """A body, and a head that only some ranks use (registered last: in the first bucket)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(
            nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128),
            nn.ReLU(), nn.Linear(128, 10),
        )  # fmt: skip
        self.head = nn.Linear(10, 10)

    def forward(self, x, use_head=True):
        out = self.body(x)
        return self.head(out) if use_head else out


def auto(model, lr=0.05, momentum=0.9, **kwargs):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    return hps.DistributedOptimizer(
        opt, named_parameters=model.named_parameters(), rank="auto", **kwargs
    )


def train(model, opt, steps, first_step=0, use_head=True):
    for step in range(first_step, first_step + steps):
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x, use_head), y).backward()
        opt.step()


def plan_of(opt):
    return [opt.compressor.ranks[b.index] for b in opt.powersgd_state.reducer.buckets]


def assert_one_plan_and_same_parameters(model, opt):
    assert_same_on_every_rank(torch.tensor(plan_of(opt), dtype=torch.float32), "plan")
    for n, p in model.named_parameters():
        assert torch.isfinite(p).all(), n
        assert_same_on_every_rank(p, n)


@pytest.mark.timeout(100)
@pytest.mark.parametrize("rounds", [1, 2])
def test_a_parameter_unused_on_one_rank_measures_and_settles(rounds):
    # Stochastic depth, or a branch taken on some ranks: the head's bucket is complete
    # in the hooks on rank 0 only. The steps that time each bucket's all-reduce once
    # waited for it inside the hook, each rank on another bucket: a hang at step 4.
    model = Branchy()
    opt = auto(model, rounds=rounds)
    head = model.head.weight
    head_bucket = next(
        b.index for b in opt.powersgd_state.reducer.buckets if any(p is head for p in b.params)
    )
    assert head_bucket == 0 and len(opt.powersgd_state.reducer.buckets) >= 3
    train(model, opt, steps=SETTLED + 2, use_head=hvd.rank() == 0)
    assert opt.powersgd_state.tuner.phase == "settled"
    assert_one_plan_and_same_parameters(model, opt)


def fake_link_timings(bytes_per_s, latency_s):
    def time_link(comm, step, device, what="link", numels=None):
        return [(n, latency_s + n / bytes_per_s) for n in (4, 256 * 1024, 4 * 2**20)]

    return time_link


@pytest.mark.timeout(100)
def test_a_replan_is_one_decision_when_the_ranks_timed_different_links(monkeypatch):
    # Every check re-plans (DRIFT 0), and the two ranks time very different links
    # (a rank's own timings differ on a real cluster too). They used to fit each
    # its own link and decide each whether to try new plans: a hang, or plans apart.
    model = Branchy()
    opt = auto(model)
    train(model, opt, steps=SETTLED)
    assert opt.powersgd_state.tuner.phase == "settled"
    monkeypatch.setattr(tuner_module, "DRIFT", 0.0)
    link = (1e10, 1e-5) if hvd.rank() == 0 else (1e6, 1e-3)
    monkeypatch.setattr(tuner_module, "_time_link", fake_link_timings(*link))
    opt.powersgd_state.tuner._next_check = opt.powersgd_step + 1
    monkeypatch.setattr(tuner_module, "CHECK_EVERY", 3)
    train(model, opt, steps=30, first_step=SETTLED)
    m = opt.powersgd_state.tuner.measurements.link
    assert_same_on_every_rank(torch.tensor([m.latency_s, m.bytes_per_s]), "link")
    assert_one_plan_and_same_parameters(model, opt)


@pytest.mark.timeout(100)
def test_failing_buckets_seen_by_one_rank_raise_its_rank_on_every_rank(monkeypatch):
    # One rank's statistics call a bucket failing, the other's do not (they are the
    # ranks' means, but a decision must never rest on that): the first rank decides.
    # It used to raise the rank on one rank only: mismatched all-reduce shapes.
    model = Branchy()
    opt = auto(model, auto_link="20mbit")
    train(model, opt, steps=tuner_module.MEASURE_STEPS + 1)
    settled = plan_of(opt)
    target = next(j for j, r in enumerate(settled) if r)  # a compressed bucket
    failing = [target] if hvd.rank() == 0 else []
    monkeypatch.setattr(tuner_module, "_failing_buckets", lambda opt: failing)
    monkeypatch.setattr(tuner_module, "TOLERANCE", 10.0)  # any raise fits the budget
    opt.powersgd_state.tuner._next_check = opt.powersgd_step + 1
    train(model, opt, steps=6, first_step=tuner_module.MEASURE_STEPS + 1)
    assert plan_of(opt)[target] != settled[target]  # rank 0's view was taken
    assert_one_plan_and_same_parameters(model, opt)


def test_a_link_variable_set_on_some_ranks_fails_on_every_rank(monkeypatch):
    model = Branchy()
    if hvd.rank() == 1:
        monkeypatch.setenv(tuner_module.LINK_ENV, "50mbit")
    else:
        monkeypatch.delenv(tuner_module.LINK_ENV, raising=False)
    with pytest.raises(ValueError, match=r"HOROVOD_POWERSGD_LINK.*on rank"):
        auto(model)
    # A bad value on one rank only: the same error on every rank, not one rank's parse error.
    monkeypatch.setenv(tuner_module.LINK_ENV, "fast" if hvd.rank() == 1 else "50mbit")
    with pytest.raises(ValueError, match=r"HOROVOD_POWERSGD_LINK.*'fast'"):
        auto(model)
    # The same bad value everywhere: every rank names the variable.
    monkeypatch.setenv(tuner_module.LINK_ENV, "fast")
    with pytest.raises(ValueError, match="HOROVOD_POWERSGD_LINK='fast'"):
        auto(model)
    monkeypatch.setenv(tuner_module.LINK_ENV, "50mbit")
    assert auto(model).powersgd_state.tuner.pinned is not None  # alike everywhere: taken


def test_a_bucket_planned_plain_travels_as_horovod_sends_it_under_a_float16_wire():
    # comm_dtype=float16 halves P and Q; a bucket auto sends plain is plain Horovod:
    # the exact fp32 average, 4 bytes an element (it travelled in float16: 7e-4 off).
    model = Branchy()
    opt = auto(model, momentum=0.0, comm_dtype=torch.float16, auto_link="20mbit")
    buckets = len(opt.powersgd_state.reducer.buckets)
    first = {id(p) for p in opt.powersgd_state.reducer.buckets[0].params}
    plain_names = [n for n, p in model.named_parameters() if id(p) in first]
    for step in range(14):
        x, y = batch(step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        average = {
            n: hvd.allreduce(g, name=f"fp16wire.{step}.{n}")
            for n, g in local_gradients(model, loss).items()
        }
        sent = opt.compression_stats()["bytes_sent"]
        loss.backward()
        opt.synchronize()
        if step == tuner_module.MEASURE_STEPS:
            opt.powersgd_state.tuner._apply(
                opt.powersgd_state, [0] + [2] * (buckets - 1)
            )  # bucket 0 plain, others r2
        if step > tuner_module.MEASURE_STEPS:
            for n in plain_names:
                p = dict(model.named_parameters())[n]
                torch.testing.assert_close(p.grad, average[n], rtol=1e-6, atol=1e-7)
            delta = opt.compression_stats()["bytes_sent"] - sent
            plain_bytes = 4 * sum(dict(model.named_parameters())[n].numel() for n in plain_names)
            assert delta > plain_bytes  # bucket 0 at 4 bytes, the rest in float16 P and Q
        with opt.skip_synchronize():
            opt.step()


def test_the_plan_reports_plain_until_start_iter_and_the_settled_plan_is_logged_taken(caplog):
    # auto measures the last MEASURE_STEPS plain steps before start_iter (a job's first
    # steps are slower than its later ones): no plan before them, every row plain; the
    # plan is taken as start_iter begins.
    model = Branchy()
    opt = auto(model, auto_link="20mbit", start_iter=12)
    with caplog.at_level("INFO", logger="horovod_powersgd"):
        train(model, opt, steps=11)
        assert opt.powersgd_state.tuner.measurements is None and not any(plan_of(opt))
        rows = opt.compression_stats()["plan"]
        assert all(row["method"] == "plain" and row["rank"] == 0 for row in rows)
        train(model, opt, steps=1, first_step=11)
        assert any(plan_of(opt)), "a 20 Mbit/s link compresses"
        rows = opt.compression_stats()["plan"]
        assert any(row["method"] == "powersgd" for row in rows)
    lines = [r.getMessage() for r in caplog.records if "auto plan" in r.getMessage()]
    if hvd.rank() == 0:
        assert len(lines) == 1 and "at step 12 (taken)" in lines[0], lines
