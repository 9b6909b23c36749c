"""Where the early warning points: at the user's line, on every rank.

A warning's location is what a user reads first and what `-W` filters and
`warnings.filterwarnings(module=...)` match. It must name the user's call
(`opt.step()`, `opt.synchronize()`, `scaler.step(opt)`), never a frame of torch
(its step wrapper, GradScaler) or of horovod_powersgd. Here the rule is made to
fire at the first check, so these tests are about the location alone; when the
rule fires is tested in tests/unit/test_monitor.py and test_stats.py.
"""

import linecache
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import batch, make_model, powersgd

import horovod_powersgd as hps
from horovod_powersgd import monitor


@pytest.fixture
def alarm_at_first_check(monkeypatch):
    monkeypatch.setattr(monitor, "SETTLE_STEPS", 0)
    monkeypatch.setattr(monitor, "growing", lambda history: True)


def _assert_points_at(warning, call):
    assert warning.filename == __file__, f"{warning.filename}:{warning.lineno}"
    line = linecache.getline(warning.filename, warning.lineno)
    assert call in line, f"line {warning.lineno}: {line.strip()!r}"


def _warning_of(step):
    """The one ErrorGrowthWarning of CHECK_EVERY steps, each ended by step(model, opt, loss)."""
    model = make_model()
    opt = powersgd(model, rank=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(monitor.CHECK_EVERY):
            x, y = batch(i)
            opt.zero_grad()
            step(model, opt, F.cross_entropy(model(x), y))
    growth = [w for w in caught if issubclass(w.category, hps.ErrorGrowthWarning)]
    assert len(growth) == 1, [str(w.message) for w in caught]
    return growth[0]


def test_warning_points_at_the_users_step_call(alarm_at_first_check):
    def step(model, opt, loss):
        loss.backward()
        opt.step()

    _assert_points_at(_warning_of(step), "opt.step()")


def test_warning_points_at_synchronize_when_the_step_skips_it(alarm_at_first_check):
    # The clipping pattern: the check runs in synchronize(), the user's line.
    def step(model, opt, loss):
        loss.backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with opt.skip_synchronize():
            opt.step()

    _assert_points_at(_warning_of(step), "opt.synchronize()")


def test_warning_points_at_scaler_step(alarm_at_first_check):
    # GradScaler.step calls opt.step() from torch's file: the user's line is the scaler's.
    # Scale 1: without synchronize() first, what the hooks send is the scaled gradient
    # (so under Horovod too); only the frames between the user and the check matter here.
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)

    def step(model, opt, loss):
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    _assert_points_at(_warning_of(step), "scaler.step(opt)")
