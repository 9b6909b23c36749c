"""The step model against published clusters: the agreements docs/scale.md states hold.

A change to planner.py or collectives.py that moves a case past what the docs say
fails here; update the docs' table and paragraphs with the test.
"""

import pytest

from horovod_powersgd.bench import published
from horovod_powersgd.bench.models import ResNet18


def test_gradients_come_from_the_architectures():
    # torchvision's counts for ResNet-50/101; the bench's own CIFAR ResNet-18.
    assert published.parameters(published.resnet50()) == 25_557_032
    assert published.parameters(published.resnet101()) == 44_549_160
    ours = sum(p.numel() for p in ResNet18().parameters())
    assert published.parameters(published.resnet18_cifar()) == ours


def test_every_case_is_deterministic_and_names_its_inputs():
    for make in published.CASES:
        first, again = make(), make()
        assert first.predicted == again.predicted
        assert first.inputs and first.source
        assert set(first.fitted) <= set(first.published)
    assert "| NCCL ring latency | 4 nodes |" in published.markdown([published.nccl_ring_latency()])


def test_nccl_ring_latency_in_one_node_is_overestimated_twice_over():
    # The model has no per-call constant: fitted to 2 GPUs, every hop costs 5 us.
    ratios = published.nccl_ring_latency_one_node().ratios()
    assert ratios["4 GPUs"] == pytest.approx(1.78, abs=0.02)
    assert ratios["8 GPUs"] == pytest.approx(2.08, abs=0.02)


def test_nccl_ring_latency_is_overestimated_by_under_10_percent():
    case = published.nccl_ring_latency()
    assert case.predicted["2 nodes"] == pytest.approx(163, rel=1e-6)  # fitted
    ratios = case.ratios()
    # Every one of the ring's 2(W-1) steps pays the inter-node hop: a little too much.
    assert 1.0 < ratios["4 nodes"] < ratios["8 nodes"] < 1.10
    assert ratios["4 nodes"] == pytest.approx(1.06, abs=0.01)
    assert ratios["8 nodes"] == pytest.approx(1.08, abs=0.01)


def test_horovod_scaling_efficiency_is_overestimated_by_about_5_percent():
    case = published.horovod_resnet101()
    assert case.predicted["512 GPUs"] == pytest.approx(0.942, abs=0.005)
    assert 1.0 < case.ratios()["512 GPUs"] < 1.10
    # The model reaches the published 90 % only with a 1-GPU step near half as long.
    assert case.predicted["1-GPU step giving 90 %, ms"] == pytest.approx(345, abs=5)


def test_powersgd_paper_needs_a_quarter_of_the_sgd_step_exposed():
    case = published.powersgd_resnet18()
    assert case.predicted["16 workers"] == pytest.approx(0.77, abs=1e-6)  # fitted
    assert case.predicted["exposed share of SGD step"] == pytest.approx(0.232, abs=0.005)


def test_pytorch_74148_flat_where_the_issue_drops_at_8_cards():
    case = published.pytorch_74148()
    ratios = case.ratios()
    assert case.predicted["8 cards, no P/Q all-reduce"] == pytest.approx(6.29, rel=1e-6)
    # 2 and 3 nodes: the model is 10 % low; 4 nodes: 15 % high.
    assert ratios["4 cards"] == pytest.approx(0.90, abs=0.01)
    assert ratios["6 cards"] == pytest.approx(0.90, abs=0.01)
    assert ratios["8 cards"] == pytest.approx(1.15, abs=0.01)
    # The model puts the P and Q all-reduces at under 1 % of the step; the issue at 15 %.
    assert case.predicted["8 cards"] / case.predicted["8 cards, no P/Q all-reduce"] > 0.99
    # Whatever a V100's step (the issue gives none), the shape stays.
    for compute_s in (0.1, 0.4):
        other = published.pytorch_74148(compute_s).predicted
        for point, value in case.predicted.items():
            assert other[point] == pytest.approx(value, rel=0.01)
