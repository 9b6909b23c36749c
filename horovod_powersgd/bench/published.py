"""The step model against published clusters: each case's inputs, prediction and published value.

    python -m horovod_powersgd.bench.published        # the table of docs/scale.md

Pure (no torch, no Horovod): the step model is stepmodel.py's on collectives.py's
cluster costs, fed synthetic measurements built from what each source publishes
(cluster shape, link, model, a timing) and, where a source is silent, an
estimate that says so in the case's `inputs`. docs/scale.md ("Checked against
published clusters") gives the sources and why each case agrees or not;
tests/unit/test_published.py holds the agreement it states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .. import stepmodel
from ..collectives import Cluster, ClusterLink, Hop, allreduce_s

FLOAT32 = 4  # bytes a gradient entry takes on the wire
MIN_COMPRESSION_RATE = 2.0  # config.PowerSGDConfig's default: P and Q must halve a matrix


@dataclass(frozen=True)
class Case:
    """One published result beside the model's prediction of it.

    `published` and `predicted` map what is compared (e.g. "4 nodes") to a value;
    `inputs` names every input with its value and where it came from.
    """

    name: str
    source: str
    quantity: str
    inputs: dict[str, str]
    published: dict[str, float]
    predicted: dict[str, float]
    fitted: tuple[str, ...] = field(default=())  # points the model was fitted to, not predicted

    def ratios(self) -> dict[str, float]:
        """Predicted over published, point by point."""
        return {k: self.predicted[k] / v for k, v in self.published.items() if k in self.predicted}


# -- the models' gradients, from their architectures ------------------------------------


def resnet_shapes(blocks: tuple[int, ...], bottleneck: bool, cifar: bool, classes: int):
    """Shapes of every parameter of a ResNet (torchvision's layout; `cifar`: a 3x3 stem).

    ResNet-50/101 (ImageNet) give torchvision's 25,557,032 / 44,549,160 parameters;
    the CIFAR ResNet-18 of bench/models.py gives its 11,173,962.
    """
    shapes = [(64, 3, 3, 3) if cifar else (64, 3, 7, 7), (64,), (64,)]
    expansion = 4 if bottleneck else 1
    in_planes = 64
    for stage, count in enumerate(blocks):
        planes = 64 * 2**stage
        for block in range(count):
            stride = 2 if stage > 0 and block == 0 else 1
            if bottleneck:
                convs = [(planes, in_planes, 1, 1), (planes, planes, 3, 3)]
                convs.append((planes * expansion, planes, 1, 1))
            else:
                convs = [(planes, in_planes, 3, 3), (planes, planes, 3, 3)]
            for conv in convs:
                shapes += [conv, (conv[0],), (conv[0],)]
            if stride != 1 or in_planes != planes * expansion:
                shapes += [(planes * expansion, in_planes, 1, 1)] + [(planes * expansion,)] * 2
            in_planes = planes * expansion
    return [*shapes, (classes, in_planes), (classes,)]


def resnet18_cifar():
    return resnet_shapes((2, 2, 2, 2), bottleneck=False, cifar=True, classes=10)


def resnet50():
    return resnet_shapes((3, 4, 6, 3), bottleneck=True, cifar=False, classes=1000)


def resnet101():
    return resnet_shapes((3, 4, 23, 3), bottleneck=True, cifar=False, classes=1000)


def parameters(shapes) -> int:
    return sum(math.prod(s) for s in shapes)


def factor_bytes(shapes, rank: int) -> tuple[float, float, float]:
    """(P bytes, Q bytes, uncompressed bytes) of one step at `rank` (the library's rule,
    `stepmodel.factor_sizes`)."""
    p = q = plain = 0.0
    for shape in shapes:
        found = stepmodel.factor_sizes(shape, rank, MIN_COMPRESSION_RATE)
        if found:
            p, q = p + FLOAT32 * found[0], q + FLOAT32 * found[1]
        else:
            plain += FLOAT32 * math.prod(shape)
    return p, q, plain


# -- synthetic measurements --------------------------------------------------------------


def synthetic(
    shapes,
    rank: int,
    bucket_bytes: float,
    step_s: float,
    backward_s: float,
    work_s: float = 0.0,
    factors: bool = True,
) -> stepmodel.Measurements:
    """A job as the step model sees it: the gradients in buckets of `bucket_bytes`, ready
    evenly through backward, each with a PowerSGD option at `rank` carrying its share of
    P, Q, the uncompressed tensors and `work_s` (half of it before the bucket leaves).

    `factors=False`: the option sends only the uncompressed tensors (PyTorch issue
    74148's run without the P and Q all-reduces). The rest of the step (forward, the
    optimizer) is `step_s - backward_s`; the link is set later (`with_link`).
    """
    total = FLOAT32 * parameters(shapes)
    count = max(1, math.ceil(total / bucket_bytes))
    p, q, plain = factor_bytes(shapes, rank)
    if not factors:
        p = q = 0.0
    share = 1.0 / count
    round1, round2 = stepmodel.per_round(p, q, plain, rounds=2)
    option = stepmodel.Option(
        compress_s=0.5 * work_s * share,
        work_s=work_s * share,
        round1_bytes=round1 * share,
        round2_bytes=round2 * share,
    )
    buckets = tuple(
        stepmodel.Bucket(backward_s * (b + 1) / count, total * share, {rank: option})
        for b in range(count)
    )
    return stepmodel.Measurements(
        buckets, backward_s, step_s, stepmodel.FREE, 2, step_s - backward_s
    )


def step_s(m: stepmodel.Measurements, cluster: Cluster, rank: int = stepmodel.PLAIN) -> float:
    """The model's step on `cluster`: plain (rank 0) or every bucket at `rank`."""
    on = m.with_link(ClusterLink(cluster))
    return stepmodel.predict(on, stepmodel.uniform(on, rank))


def _solve(f, target: float, low: float, high: float) -> float:
    """x in [low, high] with f(x) = target, f monotonic (bisection, 60 halvings)."""
    increasing = f(high) > f(low)
    for _ in range(60):
        mid = 0.5 * (low + high)
        if (f(mid) < target) == increasing:
            low = mid
        else:
            high = mid
    return 0.5 * (low + high)


# -- the cases ---------------------------------------------------------------------------

GBIT = 1e9 / 8  # bytes per second in a Gbit/s


def nccl_ring_latency() -> Case:
    """A ring's small-message all-reduce latency on 2, 4 and 8 AWS p3dn nodes of 8 GPUs.

    The per-hop latency is fitted to the 2-node time; 4 and 8 nodes are predicted.
    """
    published = {"2 nodes": 163e-6, "4 nodes": 319e-6, "8 nodes": 631e-6}
    efa, nvlink = 100 * GBIT, 100e9  # bandwidth hardly matters for 8 bytes

    def ring(nodes: int, latency_s: float) -> float:
        cluster = Cluster(nodes, 8, Hop(latency_s, nvlink), Hop(latency_s, efa))
        return allreduce_s(8, cluster, "ring")

    return _ring_latency(
        "NCCL ring latency",
        "as quoted to this project (not found in a source reachable here)",
        "2/4/8 nodes x 8 GPUs (AWS p3dn.24xlarge), 16/32/64 ranks",
        "ring (NCCL_ALGO=Ring); message 8 bytes",
        published,
        ring,
        ("node", "nodes"),
    )


def _ring_latency(name, source, cluster, algorithm, published, ring, unit) -> Case:
    """A ring's 8-byte latency at 2, 4 and 8 `unit`s: the hop fitted to 2, the rest predicted.

    `ring(count, hop latency)`: the model's seconds; `unit`: (singular, plural).
    """
    first = f"2 {unit[1]}"
    hop = _solve(lambda lat: ring(2, lat), published[first], 0.0, 1e-3)
    return Case(
        name=name,
        source=source,
        quantity="8-byte ring all-reduce, us",
        inputs={
            "cluster": cluster,
            "hop latency": f"{hop * 1e6:.2f} us, fitted to the 2-{unit[0]} time",
            "algorithm": algorithm,
        },
        published={k: v * 1e6 for k, v in published.items()},
        predicted={f"{n} {unit[1]}": ring(n, hop) * 1e6 for n in (2, 4, 8)},
        fitted=(first,),
    )


def nccl_ring_latency_one_node() -> Case:
    """A ring's 8-byte all-reduce latency on one DGX-A100, 2 to 8 GPUs, one channel.

    The per-hop latency is fitted to 2 GPUs; 4 and 8 are predicted.
    """
    published = {"2 GPUs": 10e-6, "4 GPUs": 16.88e-6, "8 GPUs": 33.7e-6}

    def ring(gpus: int, latency_s: float) -> float:
        nvlink = Hop(latency_s, 100e9)
        return allreduce_s(8, Cluster(1, gpus, nvlink, nvlink), "ring")

    return _ring_latency(
        "NCCL ring latency, 1 node",
        "github.com/NVIDIA/nccl-tests/issues/123",
        "1 DGX-A100, 2/4/8 GPUs over NVLink (source)",
        "NCCL_ALGO=Ring NCCL_MAX_NCHANNELS=1, 8 bytes (source)",
        published,
        ring,
        ("GPU", "GPUs"),
    )


def horovod_resnet101() -> Case:
    """Horovod's scaling efficiency of ResNet-101 on 512 Pascal GPUs over 25 Gbit/s RoCE."""
    shapes = resnet101()
    # 1656.82 images/s on 16 GPUs at batch 64 (Horovod's benchmark docs): 64 images a step.
    step = 64 / (1656.82 / 16)
    pcie = Hop(5e-6, 12e9)
    cluster = Cluster(128, 4, pcie, Hop(20e-6, 25 * GBIT))

    def efficiency(one_gpu_s: float) -> float:
        m = synthetic(shapes, 1, 64 * 2**20, one_gpu_s, one_gpu_s * 2 / 3)
        return one_gpu_s / step_s(m, cluster)

    at_90 = _solve(efficiency, 0.90, 0.05, 5.0)
    return Case(
        name="Horovod ResNet-101, 512 GPUs",
        source="Horovod docs/benchmarks (Sergeev & Del Balso 2018, arXiv 1802.05799)",
        quantity="scaling efficiency T(1)/T(512)",
        inputs={
            "cluster": "128 servers x 4 Pascal GPUs, RoCE 25 Gbit/s (source)",
            "gradients": f"{FLOAT32 * parameters(shapes) / 1e6:.1f} MB fp32 "
            f"({parameters(shapes):,} parameters, from the architecture)",
            "step at 1 GPU": f"{step * 1e3:.0f} ms: 64 images at 1656.82/16 images/s, the docs' "
            "16-GPU example output (estimate: hardware not stated there)",
            "backward": "2/3 of the step (estimate: backward ~ 2x forward's FLOPs)",
            "buckets": "64 MB (Horovod's default fusion threshold), ready evenly",
            "hops": "inter 20 us (estimate); intra PCIe 3 x16, 12 GB/s, 5 us (estimate)",
        },
        published={"512 GPUs": 0.90},
        predicted={"512 GPUs": efficiency(step), "1-GPU step giving 90 %, ms": at_90 * 1e3},
    )


def powersgd_resnet18() -> Case:
    """The PowerSGD paper's 16 workers, ResNet-18 on CIFAR-10: rank 2 against SGD.

    The paper's hardware, link and time per batch were not found here, so this
    case is not a prediction: it gives the share of an SGD step that exposed
    communication must take for the model to reproduce the published ratio.
    """
    shapes = resnet18_cifar()
    published = 0.77  # rank 2's time per batch over SGD's: "about 23 % faster"
    m = synthetic(shapes, 2, bucket_bytes=25 * 2**20, step_s=1.0, backward_s=2 / 3)

    def ratio(bytes_per_s: float) -> float:
        cluster = Cluster(16, 1, Hop(0.0, bytes_per_s), Hop(0.0, bytes_per_s))
        return step_s(m, cluster, 2) / step_s(m, cluster)

    bandwidth = _solve(ratio, published, 1e6, 1e12)
    cluster = Cluster(16, 1, Hop(0.0, bandwidth), Hop(0.0, bandwidth))
    sgd = step_s(m, cluster)
    p, q, plain = factor_bytes(shapes, 2)
    return Case(
        name="PowerSGD paper, 16 workers",
        source="as quoted to this project (the paper's table not reachable here)",
        quantity="rank-2 step / SGD step",
        inputs={
            "workers": "16 (as quoted)",
            "gradients": f"{FLOAT32 * parameters(shapes) / 1e6:.1f} MB fp32 "
            f"({parameters(shapes):,} parameters); rank 2 sends "
            f"{(p + q + plain) / 1e6:.2f} MB",
            "step, link": "not found: the link is solved for so that the model gives 0.77",
            "backward": "2/3 of the compute (estimate); PowerSGD's local work 0 (a lower bound)",
        },
        published={"16 workers": published},
        predicted={
            "16 workers": ratio(bandwidth),
            "exposed share of SGD step": (sgd - 1.0) / sgd,
        },
        fitted=("16 workers",),
    )


def pytorch_74148(compute_s: float = 0.25) -> Case:
    """PyTorch issue 74148: ResNet-50 on V100s, 2 per node, 3 Gbit/s, DDP's PowerSGD hook.

    The hook's local work is fitted to the run without the P and Q all-reduces
    (6.29x on 8 cards); the three runs with them are predicted. `compute_s`,
    a V100's step, is not in the issue (an estimate; the prediction barely moves
    with it because rank 1's factors are small beside 3 Gbit/s).
    """
    shapes = resnet50()
    backward = compute_s * 2 / 3

    def speedup(workers: int, work_s: float, factors: bool = True) -> float:
        m = synthetic(shapes, 1, 25 * 2**20, compute_s, backward, work_s, factors)
        cluster = Cluster(workers // 2, 2, Hop(5e-6, 10e9), Hop(50e-6, 3 * GBIT))
        return workers * compute_s / step_s(m, cluster, 1)

    work = _solve(lambda w: speedup(8, w, factors=False), 6.29, 0.0, compute_s)
    return Case(
        name="PyTorch issue 74148, 3 Gbit/s",
        source="github.com/pytorch/pytorch/issues/74148",
        quantity="speedup over 1 card",
        inputs={
            "cluster": "2/3/4 nodes x 2 V100-32GB, lowest link 3 Gbit/s (source; "
            "here every inter-node link is 3 Gbit/s, 50 us: estimate)",
            "gradients": f"{FLOAT32 * parameters(shapes) / 1e6:.1f} MB fp32 "
            f"({parameters(shapes):,} parameters); 25 MB DDP buckets",
            "rank": "1 (PowerSGDState's default; the issue does not say)",
            "step at 1 card": f"{compute_s * 1e3:.0f} ms (estimate: the issue gives none), "
            "backward 2/3 of it",
            "hook's local work": f"{work * 1e3:.1f} ms a step, fitted to 6.29x without "
            "the P and Q all-reduces on 8 cards",
        },
        published={
            "4 cards": 3.5,
            "6 cards": 5.23,
            "8 cards": 5.46,
            "8 cards, no P/Q all-reduce": 6.29,
        },
        predicted={
            "4 cards": speedup(4, work),
            "6 cards": speedup(6, work),
            "8 cards": speedup(8, work),
            "8 cards, no P/Q all-reduce": speedup(8, work, factors=False),
        },
        fitted=("8 cards, no P/Q all-reduce",),
    )


CASES = (
    nccl_ring_latency_one_node,
    nccl_ring_latency,
    horovod_resnet101,
    powersgd_resnet18,
    pytorch_74148,
)


def markdown(cases) -> str:
    lines = [
        "| case | point | published | predicted | predicted / published |",
        "| --- | --- | --- | --- | --- |",
    ]
    for case in cases:
        ratios = case.ratios()
        for point, value in case.predicted.items():
            published = case.published.get(point)
            shown = "" if published is None else f"{published:.3g}"
            if point in case.fitted:
                ratio = "fitted"
            else:
                ratio = "" if point not in ratios else f"{ratios[point]:.2f}"
            lines.append(f"| {case.name} | {point} | {shown} | {value:.3g} | {ratio} |")
    return "\n".join(lines)


def main() -> int:
    cases = [make() for make in CASES]
    print(markdown(cases))
    for case in cases:
        print(f"\n{case.name} ({case.quantity}); source: {case.source}")
        for key, value in case.inputs.items():
            print(f"  {key}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
