"""The drift guard's checksum, in one process (the collectives are in tests/parallel)."""

import pytest
import torch

from horovod_powersgd.guard import DriftGuard, checksum


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("numel", [1, 3, 1000, 1001])
def test_checksum_changes_with_any_single_element_by_one_ulp(dtype, numel):
    torch.manual_seed(numel)
    x = torch.randn(numel).to(dtype)
    assert checksum(x) == checksum(x.clone())
    up = torch.full((1,), 1e4, dtype=dtype)
    for i in {0, numel // 2, numel - 1}:
        y = x.clone()
        y[i] = torch.nextafter(y[i : i + 1], up)[0]  # the smallest change rounding can make
        assert not torch.equal(x, y)
        assert checksum(y) != checksum(x), (dtype, numel, i)


def test_checksum_of_32_bit_data_does_not_depend_on_the_summation_order():
    x = torch.randn(4097)
    assert checksum(x) == checksum(x.flip(0)) == checksum(x[torch.randperm(4097)])


def test_a_check_names_the_parameters_whose_state_differs_and_repairs_them():
    a, b = torch.zeros(4, 4), torch.ones(3)
    state = {a: {"momentum_buffer": torch.ones(4, 4)}}
    repaired = []
    other = {"a": checksum(a) + checksum(torch.ones(4, 4)) + 1, "b": checksum(b)}  # a differs
    guard = DriftGuard(
        [("a", a), ("b", b)],
        every=10,
        allgather=lambda mine, name: torch.cat(
            [mine, torch.tensor([[int(other["a"]), int(other["b"])]], dtype=torch.int64)]
        ),
        broadcast=lambda tensors, name: repaired.extend(tensors),
    )
    assert [guard.due(step) for step in (1, 10, 15, 20)] == [False, True, False, True]
    assert guard.check(state) == ["a"]
    assert [t.data_ptr() for t in repaired] == [
        a.data_ptr(),
        state[a]["momentum_buffer"].data_ptr(),
    ]
    assert guard.repairs == 1
