"""HOROVOD_POWERSGD_ORTHOGONALIZE=cholesky: the user contract with CholeskyQR (linalg.py).

The unit tests hold both methods to the same guarantees matrix by matrix
(tests/unit/test_compressor.py); here the contract of whole jobs runs again with
CholeskyQR, and the setting is one decision for all ranks.
"""

import os

import horovod.torch as hvd
import pytest
import test_checkpoint as checkpoint
import test_optimizer as contract
import test_transformer as transformer
import torch
from helpers import make_model, powersgd

from horovod_powersgd import linalg


@pytest.fixture
def cholesky(monkeypatch):
    monkeypatch.setenv(linalg.METHOD_ENV, "cholesky")
    monkeypatch.setattr(linalg, "METHOD", linalg.METHOD)  # put back afterwards
    yield
    assert linalg.METHOD == "cholesky"  # the jobs above ran with it


@pytest.mark.parametrize(
    "test",
    [
        contract.test_full_rank_equals_plain_horovod_average,
        contract.test_parameters_bitwise_identical_on_every_rank_after_many_steps,
        contract.test_unused_and_non_finite_gradients_leave_state_finite,
        contract.test_amp_grad_scaler_and_clipping_pattern,
        contract.test_compression_stats_follow_the_formula,
        transformer.test_full_rank_adamw_gets_horovods_average_and_stays_identical_on_every_rank,
    ],
    ids=lambda test: test.__name__,
)
def test_the_contract_holds_with_cholesky_qr(test, cholesky):
    test()


def test_resume_is_bit_exact_with_cholesky_qr(cholesky, shared_dir):
    checkpoint.test_resume_is_bit_exact(os.path.join(shared_dir, "ckpt.pt"))


def test_the_setting_differing_across_ranks_fails_on_every_rank(monkeypatch):
    monkeypatch.setattr(linalg, "METHOD", linalg.METHOD)
    if hvd.rank() == 1:
        monkeypatch.setenv(linalg.METHOD_ENV, "cholesky")
    else:
        monkeypatch.delenv(linalg.METHOD_ENV, raising=False)
    with pytest.raises(ValueError, match=r"HOROVOD_POWERSGD_ORTHOGONALIZE.*on rank"):
        powersgd(make_model(), rank=2)
    # The same bad value everywhere: every rank names the variable and its choices.
    monkeypatch.setenv(linalg.METHOD_ENV, "qr")
    with pytest.raises(ValueError, match=r"HOROVOD_POWERSGD_ORTHOGONALIZE='qr'.*householder"):
        powersgd(make_model(), rank=2)
    monkeypatch.delenv(linalg.METHOD_ENV)
    powersgd(make_model(), rank=2)
    assert linalg.METHOD == "auto"  # unset: the default, by device
    assert linalg.method_for(torch.device("cpu")) == "householder"
    assert linalg.method_for(torch.device("cuda")) == "cholesky"  # no launch per matrix
    monkeypatch.setenv(linalg.METHOD_ENV, "householder")  # chosen: on every device
    powersgd(make_model(), rank=2)
    assert linalg.method_for(torch.device("cuda")) == "householder"
