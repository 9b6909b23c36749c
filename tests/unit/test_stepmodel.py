"""The step model (stepmodel.py): what it reads back, and the rule of what a gradient sends."""

import dataclasses
import json
import math

import pytest

from horovod_powersgd import stepmodel
from horovod_powersgd.collectives import Hop
from horovod_powersgd.config import PowerSGDConfig
from horovod_powersgd.stepmodel import Bucket, Measurements, Option, Tensor


def measured() -> Measurements:
    option = Option(0.002, 0.005, 2e4, 1e4, 0.001, 0.0005)
    tensor = Tensor(10**6, 4, 4e6, {2: (8e3, 4e3)})
    buckets = (Bucket(0.01, 4e6, {2: option}, (tensor,)), Bucket(0.02, 4e6, {1: option, 2: option}))
    return Measurements(buckets, 0.02, 0.08, Hop(1e-4, math.inf), 2, 0.03, workers=3)


def old_checkpoint(m: Measurements) -> dict:
    """rank="auto"'s measurements as a checkpoint held them before they were kept as a
    profile (tuner.py's own layout, written here as it wrote it)."""
    return {
        "buckets": [
            [b.ready_s, b.plain_bytes, [[r, *dataclasses.astuple(o)] for r, o in b.options.items()]]
            for b in m.buckets
        ],
        "backward_s": m.backward_s,
        "step_s": m.step_s,
        "rest_s": m.rest_s,
        "link": [m.link.latency_s, m.link.bytes_per_s],
    }


@pytest.mark.parametrize("rounds", [1, 2])
def test_a_checkpoint_written_before_the_one_layout_still_loads(rounds):
    m = measured()
    back = Measurements.from_dict(old_checkpoint(m), rounds)
    # What that layout kept, and the schedule of the job that resumes.
    kept = [dataclasses.replace(b, tensors=()) for b in m.buckets]
    assert back == dataclasses.replace(m, buckets=tuple(kept), rounds=rounds, workers=None)
    plan = [2, 1]
    assert stepmodel.predict(back, plan) == stepmodel.predict(
        dataclasses.replace(m, rounds=rounds), plan
    )


def test_a_checkpoints_plan_is_a_profile_read_for_the_resumed_schedule():
    m = measured()
    state = json.loads(json.dumps(m.to_dict()))  # what torch.save keeps is the same dict
    assert Measurements.from_dict(state, m.rounds) == m == Measurements.from_dict(state)
    assert Measurements.from_dict(state, 1).rounds == 1


@pytest.mark.parametrize(
    "shape", [(64, 32, 3, 3), (10, 10), (1000, 3), (64,), (0, 5), (5, 0, 2), (7, 1), (512, 512)]
)
@pytest.mark.parametrize("rank", [1, 2, 4, 64])
@pytest.mark.parametrize("rate", [0.5, 1.0, 2.0])
def test_the_library_and_the_model_compress_the_same_gradients(shape, rank, rate):
    config = PowerSGDConfig(rank=rank, min_compression_rate=rate)
    found = stepmodel.factor_sizes(shape, rank, rate)
    assert config.compresses(shape) == (found is not None)
    if found:
        n, m = shape[0], math.prod(shape[1:])
        r = config.matrix_rank(n, m)
        assert found == (r * n, r * m)


def _job(link: Hop, workers: int = 4) -> Measurements:
    """Two buckets of one large matrix each (ranks 1 and 4), and one of biases only."""
    out = []
    for ready in (0.01, 0.02):
        tensor = Tensor(10**6, 4, 4e6, {1: (4e3, 4e3), 4: (16e3, 16e3)})
        options = {r: Option(0.002 * r, 0.004 * r, *stepmodel.message_bytes([tensor], r, 2))
                   for r in (1, 4)}  # fmt: skip
        out.append(Bucket(ready, 4e6, options, (tensor,)))
    out.append(Bucket(0.025, 4e4, {}, (Tensor(10**4, 4, 4e4),)))
    return Measurements(tuple(out), 0.025, 0.1, link, 2, 0.05, workers=workers)


def test_a_node_step_is_the_slowest_shares_and_the_planner_compresses_every_bucket_it_can():
    from horovod_powersgd import planner
    from horovod_powersgd.collectives import Cluster, per_link

    fast_node = Hop(2e-5, 5e9)
    for link in (Hop(1e-4, 1e10), Hop(1e-3, 12.5e6)):  # no link to speak of; 100 Mbit/s
        job = stepmodel.NodeSteps(_job(link), per_node=2, intra=fast_node)
        cluster = Cluster(2, 2, per_link(fast_node, 2), per_link(link, 4))
        assert job.cluster == cluster
        for plan in ([1, 1, 0], [4, 1, 0], [4, 4, 0]):
            shares = stepmodel.hierarchical(job.flat, cluster)
            assert stepmodel.predict(job, plan) == max(stepmodel.predict(s, plan) for s in shares)
        # Plain is no choice for a bucket that can be compressed (its node stages are
        # not in the model), whatever the link; the biases' bucket stays plain.
        # A rank of the ladder no bucket can take (8) is no way to plain either.
        chosen = planner.choose(job, [1, 4, 8])
        assert 0 not in chosen[:2] and chosen[2] == 0, chosen
        for plan in planner.candidates(job, [1, 4, 8]):
            assert 0 not in plan[:2], plan
        assert planner.raise_failing(job, [4, 4, 0], [0], 1e9) == [4, 4, 0]  # no plain above
    # Flat, on the fast link, the same job is planned plain: the choice is the model's.
    assert planner.choose(_job(Hop(1e-4, 1e10)), [1, 4]) == [0, 0, 0]
    # Another link between the nodes: only the inter-node hop changes.
    job = stepmodel.NodeSteps(_job(Hop(1e-4, 1e10)), per_node=2, intra=fast_node)
    slow = job.with_link(Hop(1e-3, 12.5e6))
    assert slow.cluster.intra == job.cluster.intra
    assert slow.cluster.inter == per_link(Hop(1e-3, 12.5e6), 4)
    assert stepmodel.predict(slow, [4, 4, 0]) > stepmodel.predict(job, [4, 4, 0])


def test_hierarchical_auto_runs_hierarchical_where_the_model_expects_it_faster_only():
    """hierarchical="auto" with rank="auto" (planner.hierarchical_pays): each layout's
    chosen plan on the same measurements; hierarchical only where its step is shorter
    than flat's by more than the tolerance."""
    from horovod_powersgd import planner

    fast_node = Hop(2e-5, 5e9)
    slow = Hop(1e-3, 12.5e6)  # 100 Mbit/s between the nodes
    job = stepmodel.NodeSteps(_job(slow), per_node=2, intra=fast_node)
    pays, flat_s, nodes_s = planner.hierarchical_pays(job.flat, job, [1, 4])
    assert pays and nodes_s < flat_s * 0.97, (flat_s, nodes_s)
    assert flat_s == stepmodel.predict(job.flat, planner.choose(job.flat, [1, 4]))
    assert nodes_s == stepmodel.predict(job, planner.choose(job, [1, 4]))
    # 4 % faster is not faster by more than a tolerance of 10 %: flat.
    assert not planner.hierarchical_pays(job.flat, job, [1, 4], tolerance=0.1)[0]
    # No link to speak of: flat sends plain, faster than any compressed node step.
    job = stepmodel.NodeSteps(_job(Hop(1e-4, 1e10)), per_node=2, intra=fast_node)
    assert not planner.hierarchical_pays(job.flat, job, [1, 4])[0]
    # A node whose own link is as slow as the one between nodes: its stages cost more
    # than the shares save.
    job = stepmodel.NodeSteps(_job(slow), per_node=2, intra=slow)
    pays, flat_s, nodes_s = planner.hierarchical_pays(job.flat, job, [1, 4])
    assert not pays and nodes_s > flat_s, (flat_s, nodes_s)


@pytest.mark.parametrize("rounds", [2, 1])
def test_the_flat_step_is_timed_in_the_reducers_order(rounds):
    """Each bucket's compression in its hook (delaying backward), its first round when the
    link is free; once every first round is back, the rest of every bucket's local work,
    and rounds=2's Q of every bucket as one all-reduce: one latency, not one a bucket.
    Worked by hand for two buckets on a link of 1 ms and 1 MB/s."""
    link = Hop(1e-3, 1e6)
    a = Option(compress_s=0.002, work_s=0.010, round1_bytes=4e3, round2_bytes=2e3)
    b = Option(compress_s=0.003, work_s=0.007, round1_bytes=1e3, round2_bytes=1e3)
    buckets = (Bucket(0.010, 1e5, {2: a}), Bucket(0.020, 1e5, {2: b}))
    m = Measurements(buckets, 0.030, 0.1, link, rounds, rest_s=0.05)
    # a leaves at 0.010 + 0.002 and takes 5 ms: the link is busy until 0.017; b's hook
    # runs at 0.020 + 0.002 (a's compression before it) + 0.003 and takes 2 ms: 0.027.
    # Backward ends at 0.030 + 0.005, after both: then 8 + 4 ms of the rest of the work.
    first_rounds = max(0.030 + 0.005, 0.027)
    expected = first_rounds + 0.008 + 0.004
    if rounds == 2:
        expected += 1e-3 + 3e3 / 1e6  # every Q in one message
    assert stepmodel.predict(m, [2, 2]) == pytest.approx(0.05 + expected)
    # Plain buckets leave when ready (no local work), after the link frees up.
    assert stepmodel.predict(m, [0, 0]) == pytest.approx(0.05 + max(0.030, 0.010 + 0.101 + 0.101))
