"""The GPU kit's pieces that need no Horovod job: its models and how its report reads a run.

The kit runs once per device lease, so what it reports must be right the first time:
the models must be the ones the issue names (their parameter counts, and the shapes the
op count and the published cases use), and a host read must be called by design only
where it is.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "gpu"))
import gpu_check

from horovod_powersgd.bench import dispatch, published
from horovod_powersgd.bench import models as gpu_models


@pytest.mark.parametrize(
    ("name", "count"),
    [("resnet50", gpu_models.RESNET50_PARAMETERS), ("gpt2", gpu_models.GPT2_PARAMETERS)],
)
def test_full_size_models_have_the_published_parameter_counts(name, count):
    # On the meta device: shapes only, no memory (GPT-2 small is half a gigabyte).
    model = gpu_models.workload(name, "full", torch.device("meta")).model
    assert sum(p.numel() for p in model.parameters()) == count


def test_the_op_count_and_the_published_cases_take_resnets_shapes_from_the_models():
    # One ResNet definition: bench/dispatch counts ops on its shapes, and bench/published
    # (pure, no torch) writes the same shapes from the architecture's rule.
    resnet50 = gpu_models.parameter_shapes(gpu_models.ResNet50)
    assert dispatch.resnet50_shapes() == resnet50 == published.resnet50()
    resnet101 = gpu_models.parameter_shapes(lambda: gpu_models.ResNet50(blocks=(3, 4, 23, 3)))
    assert published.resnet101() == resnet101
    assert published.resnet18_cifar() == gpu_models.parameter_shapes(gpu_models.ResNet18)


def test_gpt2_output_layer_is_the_token_embedding():
    model = gpu_models.workload("gpt2", "tiny", torch.device("cpu")).model
    assert model.head.weight is model.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "head.weight" not in names  # sent (and compressed) once, as DDP and Horovod see it


@pytest.mark.parametrize("name", ["resnet50", "gpt2"])
def test_tiny_models_train_a_step_on_the_cpu(name):
    workload = gpu_models.workload(name, "tiny", torch.device("cpu"))
    batch = workload.batch(torch.Generator().manual_seed(0))
    loss = workload.loss(workload.model, batch)
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in workload.model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize(
    ("steps", "cpu_only", "why"),
    [
        ([2, 3, 4, 5], True, "CPU fast path"),
        ([1], False, "first step"),
        ([10, 20], False, "statistics every 10"),
        ([1, 20], False, "drift check every 20"),
        ([20], False, "drift check every 20"),
        ([10], False, "statistics every 10"),
        ([1, 7], False, "NOT BY DESIGN"),
        ([3, 4, 5, 6], False, "NOT BY DESIGN"),
        ([10, 15], False, "NOT BY DESIGN"),
    ],
)
def test_report_calls_a_host_read_by_design_only_on_its_documented_steps(steps, cpu_only, why):
    entry = {"steps": steps, "cpu_only": cpu_only}
    assert gpu_check.classify(entry, drift_every=20).startswith(why)


def test_report_judges_the_target_only_on_a_gpu():
    model = {
        "forward_backward_ms": {"fp32": 100.0, "bf16": 40.0},
        "local_work": {"rank 4, rounds=2": {"with_statistics_ms": 3.0}},
        "hook": {"rank 4, batched": {"overhead_ms": {"fp32": 4.0, "bf16": 4.0}}},
    }
    gpu = " ".join(gpu_check._verdict(model, cuda=True))
    # 3 % of the fp32 step and under the hook: met; 7.5 % of the bf16 step: missed.
    assert "fp32: rank 4 local work with statistics 3.0 %" in gpu
    assert "fp32: rank 4 local work with statistics 3.0 % of forward+backward, hook 4.00 ms: " \
        "meets the target" in gpu  # fmt: skip
    assert "bf16: rank 4 local work with statistics 7.5 % of forward+backward, hook 4.00 ms: " \
        "misses the target" in gpu  # fmt: skip
    assert "not judged (CPU)" in " ".join(gpu_check._verdict(model, cuda=False))
    # Judged on CholeskyQR's rows where there are some: the method a GPU uses by default.
    model["local_work"]["rank 4, rounds=2, cholesky"] = {"with_statistics_ms": 5.0}
    assert "fp32: rank 4 local work with statistics 5.0 %" in " ".join(
        gpu_check._verdict(model, cuda=True)
    )
