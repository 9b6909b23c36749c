"""Every setting is validated up front, with a message that names it."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from horovod_powersgd import PowerSGDConfig

BAD = [
    ({"rank": 0}, "rank"),
    ({"rank": -3}, "rank"),
    ({"rank": 2.5}, "rank"),
    ({"rank": True}, "rank"),
    ({"start_iter": -1}, "start_iter"),
    ({"min_compression_rate": -0.5}, "min_compression_rate"),
    ({"min_compression_rate": float("nan")}, "min_compression_rate"),
    ({"min_compression_rate": float("inf")}, "min_compression_rate"),
    ({"error_feedback": 1}, "error_feedback"),
    ({"warm_start": "yes"}, "warm_start"),
    ({"seed": 1.5}, "seed"),
    ({"comm_dtype": torch.int8}, "comm_dtype"),
    ({"comm_dtype": torch.bfloat16}, "comm_dtype=torch.bfloat16 cannot be sent"),
    ({"comm_dtype": "float16"}, "comm_dtype"),
    ({"backward_passes_per_step": 0}, "backward_passes_per_step"),
    ({"gradient_predivide_factor": 0.0}, "gradient_predivide_factor"),
    ({"rounds": 0}, "rounds"),
    ({"rounds": 3}, "rounds"),
    ({"rounds": True}, "rounds"),
    ({"rounds": 1.0}, "rounds"),
    ({"sparse_as_dense": 1}, "sparse_as_dense"),
]


@pytest.mark.parametrize(("kwargs", "field"), BAD)
def test_bad_setting_is_rejected_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PowerSGDConfig(**kwargs)


@given(
    rank=st.integers(1, 64),
    start_iter=st.integers(0, 10_000),
    rate=st.floats(0, 1e6, allow_nan=False),
    passes=st.integers(1, 16),
    factor=st.floats(1e-3, 1e3, allow_nan=False),
    comm_dtype=st.sampled_from([None, torch.float16, torch.float32, torch.float64]),
)
def test_every_valid_setting_is_accepted(rank, start_iter, rate, passes, factor, comm_dtype):
    cfg = PowerSGDConfig(
        rank=rank,
        start_iter=start_iter,
        min_compression_rate=rate,
        backward_passes_per_step=passes,
        gradient_predivide_factor=factor,
        comm_dtype=comm_dtype,
    )
    assert cfg.rank == rank


@given(rank=st.integers(-1000, 0) | st.floats(allow_nan=True) | st.text())
def test_every_invalid_rank_is_rejected(rank):
    with pytest.raises(ValueError, match="rank"):
        PowerSGDConfig(rank=rank)


@given(
    n=st.integers(1, 4096),
    m=st.integers(1, 4096),
    rank=st.integers(1, 64),
    rate=st.floats(0, 100, allow_nan=False),
)
def test_compressed_tensors_shrink_by_at_least_the_rate(n, m, rank, rate):
    cfg = PowerSGDConfig(rank=rank, min_compression_rate=rate)
    if cfg.compresses(torch.Size([n, m])):
        r = cfg.matrix_rank(n, m)
        assert r <= min(n, m)
        assert n * m >= rate * r * (n + m)
