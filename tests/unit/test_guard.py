"""The drift guard's fingerprint, in one process (the collectives are in tests/parallel)."""

import pytest
import torch

from horovod_powersgd.guard import DriftGuard, fingerprint


def same(a, b):
    return torch.equal(fingerprint(a), fingerprint(b))


def nudge_(x, i, direction):
    """Move element i of x by one ulp, in place (its bits by +-1 where x[i] > 0)."""
    target = torch.full((1,), float("inf") if direction > 0 else 0.0, dtype=x.dtype)
    x.view(-1)[i] = torch.nextafter(x.view(-1)[i : i + 1], target)[0]
    return x


def ulp(x, i, direction):
    """x with element i moved by one ulp."""
    return nudge_(x.clone(), i, direction)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("numel", [1, 3, 1000, 1001, 70_001])
def test_fingerprint_changes_with_any_single_element_by_one_ulp(dtype, numel):
    torch.manual_seed(numel)
    x = torch.randn(numel).abs().to(dtype) + 1
    assert same(x, x.clone())
    for i in {0, numel // 2, numel - 1}:
        y = ulp(x, i, +1)
        assert not torch.equal(x, y)
        assert not same(x, y), (dtype, numel, i)


@pytest.mark.parametrize("numel", [1000, 4096 * 3 + 5, 1_000_003])
def test_no_pair_of_opposite_one_ulp_changes_cancels(numel):
    # Bits +1 at one element and -1 at another: a position-free sum of the bits
    # missed these about half the time (issue 36, item 1).
    x = torch.rand(numel) + 1
    y, before = x.clone(), fingerprint(x)
    g = torch.Generator().manual_seed(numel)
    pairs = [tuple(torch.randint(0, numel, (2,), generator=g).tolist()) for _ in range(200)]
    # and pairs in the same column of the folded view, and in the same row
    pairs += [(0, 4096), (5, 4096 * 2 + 5), (0, 1), (4096, 4096 + 7)]
    for i, j in pairs:
        if i == j or j >= numel:
            continue
        nudge_(nudge_(y, i, +1), j, -1)
        assert not torch.equal(fingerprint(y), before), (i, j)
        y[i], y[j] = x[i], x[j]


@pytest.mark.parametrize("changes", [2, 10, 100])
def test_random_one_ulp_changes_are_never_missed(changes):
    x = torch.rand(50_000) + 1
    y, before = x.clone(), fingerprint(x)
    g = torch.Generator().manual_seed(changes)
    for _ in range(100):
        where = torch.randperm(x.numel(), generator=g)[:changes]
        signs = torch.randint(0, 2, (changes,), generator=g).tolist()
        for i, s in zip(where.tolist(), signs):
            nudge_(y, i, 1 if s else -1)
        assert not torch.equal(fingerprint(y), before)
        y[where] = x[where]


def test_fingerprint_depends_on_the_bits_only_not_on_layout_or_threads():
    x = torch.randn(64, 4099)
    strided = x.t().contiguous().t()  # the same values in another memory layout
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fingerprint(x)
        torch.set_num_threads(2)
        assert torch.equal(fingerprint(x), one)
        assert torch.equal(fingerprint(strided), one)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("numel", [1, 3, 5, 4099 * 4 + 3])
def test_odd_sized_one_and_two_byte_tensors_have_a_fingerprint(numel):
    mask = torch.zeros(numel, dtype=torch.bool)
    flipped = mask.clone()
    flipped[numel - 1] = True
    assert same(mask, mask.clone()) and not same(mask, flipped)
    half = torch.ones(numel, dtype=torch.float16)
    assert not same(half, ulp(half, numel - 1, +1))


def test_a_large_tensor_is_folded_to_a_short_fingerprint():
    assert fingerprint(torch.zeros(1_000_000)).numel() < 5000


class FakeComm:
    """The guard's two collectives, in one process."""

    def __init__(self, allgather, repaired):
        self.allgather = allgather
        self.repaired = repaired

    def broadcast_(self, tensors, name):
        self.repaired.extend(tensors)


def test_a_check_names_the_parameters_whose_state_differs_and_repairs_them():
    a, b = torch.zeros(4, 4), torch.ones(3)
    state = {a: {"momentum_buffer": torch.ones(4, 4)}}
    repaired = []
    gathered = []

    def allgather(mine, name):
        # another rank whose 'a' value differs: the second half of a row holds value hashes
        other = mine.clone()
        other[0, 2] += 1
        gathered.append(mine)
        return torch.cat([mine, other])

    guard = DriftGuard([("a", a), ("b", b)], every=10, comm=FakeComm(allgather, repaired))
    assert [guard.due(step) for step in (1, 10, 15, 20)] == [False, True, False, True]
    assert guard.check(state) == ["a"]
    assert [t.data_ptr() for t in repaired] == [
        a.data_ptr(),
        state[a]["momentum_buffer"].data_ptr(),
    ]
    assert guard.repairs == 1
    # the same values give the same message again; other values another one
    guard.check(state)
    assert torch.equal(gathered[0], gathered[1])
    state[a]["momentum_buffer"][1, 1] = 2.0
    guard.check(state)
    assert gathered[2][0, 2] != gathered[0][0, 2] and gathered[2][0, 3] == gathered[0][0, 3]


def test_a_check_refuses_optimizer_states_of_different_layouts():
    a = torch.zeros(4, 4)
    state = {a: {"exp_avg": torch.zeros(4, 4)}}

    def allgather(mine, name):
        other = mine.clone()
        other[0, 0] += 1  # another rank's state holds other tensors
        return torch.cat([mine, other])

    guard = DriftGuard([("a", a)], every=1, comm=FakeComm(allgather, None))
    with pytest.raises(ValueError, match=r"parameter 'a' holds other tensors.*ranks \[1\]"):
        guard.check(state)


def test_a_sparse_tensor_is_fingerprinted_by_its_indices_and_values():
    # SGD's momentum of sparse gradients is sparse (issue 52, item 2).
    dense = torch.zeros(50, 4)
    dense[[3, 7]] = torch.randn(2, 4)
    sparse = dense.to_sparse(1)
    assert torch.equal(fingerprint(sparse), fingerprint(dense.to_sparse(1)))
    moved = dense.clone()
    moved[7, 2] = torch.nextafter(moved[7, 2], torch.tensor(1.0))
    assert not torch.equal(fingerprint(sparse), fingerprint(moved.to_sparse(1)))
    shifted = torch.zeros(50, 4)
    shifted[[3, 8]] = dense[[3, 7]]
    assert not torch.equal(fingerprint(sparse), fingerprint(shifted.to_sparse(1)))
